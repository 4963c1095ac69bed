"""The step's host operations in the CPU runtime's C++ kernel (protocol.StepOps; kernels/tree.cpp): the
best-first heap, the tree's tokens, its visibility and positions, and the greedy argmax + walk, each one call
where numpy / torch take dozens of small ops. The same results as the engine's reference operations
(ddtree/engine/step_ops.py; tests/test_step_ops.py), except that equal log-probs within a depth are ordered by token
id here, as torch.topk orders them there. Inputs the kernel does not take (not float32 on the CPU) go to the
reference arithmetic that the models define (the Markov head's numpy tables) or to torch."""
from __future__ import annotations

import numpy as np
import torch

from ...models.markov import head_chain_ids, head_tree_nodes


def _host_f32(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


class KernelStepOps:
    """protocol.StepOps through `kernel` (the compiled extension: ddtree.runtime.cpu.qlinear.kernel())."""

    def __init__(self, kernel):
        self.kernel = kernel

    def root(self, token: int, device: torch.device) -> torch.Tensor:
        return torch.full((1,), token, dtype=torch.long)

    def path_rows(self, path: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(path)

    def tree_nodes(self, drafter, logprobs: torch.Tensor, bonus: torch.Tensor, budget: int) -> tuple:
        if drafter.markov is not None:
            return head_tree_nodes(drafter, logprobs, bonus, budget, self.kernel)
        if not _host_f32(logprobs):
            raise ValueError("the CPU runtime's tree build takes float32 CPU log-probs")
        parents, depths, ids, scores = self.kernel.best_first_tree(logprobs.contiguous(), budget)
        return parents.numpy(), depths.numpy(), ids, scores.numpy()

    def chain_ids(self, drafter, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        if drafter.markov is not None:
            return head_chain_ids(drafter, logits, bonus, self.kernel)
        if _host_f32(logits) and logits.dim() == 2:
            return self.kernel.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def tree_tokens(self, drafter, bonus: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.tree_tokens(int(bonus), ids.contiguous(), drafter.d2t if drafter.cfg.reduced_vocab else None)

    def visibility(self, parents: np.ndarray, depths: np.ndarray, start: int, device: torch.device):
        ancestors, positions = self.kernel.tree_visibility(parents, depths, start)
        return (ancestors if len(parents) > 1 else None), positions

    def greedy_walk(self, tree, ancestors, logits: torch.Tensor):
        if logits.dtype != torch.float32:
            logits = logits.float()  # a max is exact in float32 for float16 / bfloat16 values
        return self.kernel.greedy_walk(logits.contiguous(), tree.parents, tree.tokens)  # argmax + walk, one call
