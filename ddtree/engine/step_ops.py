"""The step's host operations in numpy / torch (protocol.StepOps): what a target without a runtime of its own (the
reference model, the transformers backend, the CUDA runtime) runs. The CPU runtime supplies the same operations
in its C++ kernel (ddtree/runtime/cpu/step_ops.py), held to these results by tests/test_step_ops.py."""
from __future__ import annotations

import numpy as np
import torch

from ..models.markov import head_chain_ids, head_tree_nodes
from .sampling import argmax
from .tree import ancestor_matrix, best_first_nodes, walk


class TorchStepOps:
    """protocol.StepOps on the model's device, with the tree's bookkeeping in numpy."""

    def root(self, token: int, device: torch.device) -> torch.Tensor:
        return torch.full((1,), token, dtype=torch.long, device=device)

    def path_rows(self, path: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(path, device=device)

    def tree_nodes(self, drafter, logprobs: torch.Tensor, bonus: torch.Tensor, budget: int) -> tuple:
        if drafter.markov is not None:
            return head_tree_nodes(drafter, logprobs, bonus, budget)
        parents, depths, ids, scores = best_first_nodes(logprobs, budget)
        return parents, depths, torch.tensor(ids, dtype=torch.long, device=logprobs.device), scores

    def chain_ids(self, drafter, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        return argmax(logits) if drafter.markov is None else head_chain_ids(drafter, logits, bonus)

    def tree_tokens(self, drafter, bonus: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([bonus, drafter.to_target_ids(ids)])

    def visibility(self, parents: np.ndarray, depths: np.ndarray, start: int, device: torch.device):
        ancestors = torch.from_numpy(ancestor_matrix(parents, depths)).to(device) if len(parents) > 1 else None
        return ancestors, torch.from_numpy(depths).to(device) + start

    def greedy_walk(self, tree, ancestors, logits: torch.Tensor):
        return walk(tree, ancestors, argmax(logits))
