"""The step's operations for a target whose passes take their inputs from the host (Target.host_inputs: the CUDA-graph
runtime), with two waits on the device per greedy step.

Each host read of a device tensor (.tolist(), .item(), a copy into pageable memory) and each upload from pageable
memory stalls the host until the device has drained everything queued before it; at batch size 1 on a GPU, a step
made of a dozen such round trips keeps the device idle between them. Here a step's bookkeeping stays on the host:

    draft logits -> log-softmax -> ONE top-k [depth, k] -> one copy back into pinned memory   (wait 1)
    best-first heap, tokens (d2t on the host), visibility, positions: host work on host tensors
    the runtime packs tokens, positions and mask bits into one pinned buffer: one upload, no wait
    verify -> argmax [N] -> one copy back into pinned memory                                   (wait 2)
    walk on the host; the accepted rows go up from pinned memory without a wait; the next draft is queued

The trees and tokens are those of TorchStepOps (ddtree/engine/step_ops.py): the same heap over the same ranks, read
from one top-k of the whole budget where TorchStepOps first reads 32 ranks a depth and fetches deeper ones when the
heap reaches them. `waits` counts the copies back, each a wait on the device (tests hold a greedy step to two).
"""
from __future__ import annotations

import numpy as np
import torch

from ..models.markov import head_chain_ids, head_tree_nodes
from .step_ops import TorchStepOps
from .tree import ancestor_matrix, best_first_topk, walk


def step_ops_for(target):
    """The step operations a decoding loop over `target` runs: its runtime's own, else these where its passes take
    host inputs, else the engine's reference ones."""
    if target.step_ops is not None:
        return target.step_ops
    return StagedStepOps(target.device) if target.host_inputs else TorchStepOps()


class StagedStepOps:
    """protocol.StepOps with the step's bookkeeping on the host and one copy back per draft and per verify."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"  # page-locked host memory: copies that do not stall the host
        self.waits = 0
        self._d2t: tuple | None = None  # (the drafter's d2t, its version counter then, its host copy)
        self._copied = torch.cuda.Event() if self.pinned else None

    def _copy_back(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Device tensors copied into fresh host tensors, then one wait for all of them: one of the step's waits."""
        self.waits += 1
        if not self.pinned:
            return [t.cpu() for t in tensors]
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(out, tensors):
            host.copy_(t, non_blocking=True)
        self._copied.record()  # an event after the copies: the wait ends when they have landed (torch's sync debug
        self._copied.synchronize()  # mode does not count an event's wait: tests hold a step to these)
        return out

    def root(self, token: int, device: torch.device) -> torch.Tensor:
        return torch.tensor([token], dtype=torch.long)  # on the host: the runtime fills its passes' inputs from it

    def path_rows(self, path: list[int], device: torch.device) -> torch.Tensor:
        rows = torch.tensor(path, dtype=torch.long)
        if self.pinned:  # the caching host allocator keeps the block until the copy has run
            return rows.pin_memory().to(device, non_blocking=True)
        return rows.to(device)

    def tree_nodes(self, drafter, logprobs: torch.Tensor, bonus: torch.Tensor, budget: int) -> tuple:
        if drafter.markov is not None:  # the head reads its tables per node: the reference ops, on the device
            parents, depths, ids, scores = head_tree_nodes(drafter, logprobs, bonus.to(logprobs.device), budget)
            return parents, depths, self._copy_back(ids)[0], scores
        vals, ids = logprobs.topk(min(budget, logprobs.shape[-1]), dim=-1)  # [depth, k]
        vals, ids = self._copy_back(vals, ids)
        parents, depths, tokens, scores = best_first_topk(vals.tolist(), ids.tolist(), budget)
        return parents, depths, torch.tensor(tokens, dtype=torch.long), scores

    def chain_ids(self, drafter, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        if drafter.markov is not None:
            return self._copy_back(head_chain_ids(drafter, logits, bonus.to(logits.device)))[0]
        return self._copy_back(logits.argmax(dim=-1))[0]

    def tree_tokens(self, drafter, bonus: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type != "cpu":
            ids = self._copy_back(ids)[0]
        if drafter.cfg.reduced_vocab:
            ids = ids + self._host_d2t(drafter)[ids]
        return torch.cat([bonus.cpu(), ids])

    def _host_d2t(self, drafter) -> torch.Tensor:
        """The drafter's draft -> target offsets on the host, copied once, and again where the drafter's table was
        replaced or written in place (its version counter; set_draft_vocab writes it in place)."""
        d2t = drafter.d2t
        version = 0 if d2t.is_inference() else d2t._version  # inference tensors have no version counter
        if self._d2t is None or self._d2t[0] is not d2t or self._d2t[1] != version:
            self._d2t = (d2t, version, d2t.to("cpu", copy=True))  # a copy on the host too: its version is what counts
        return self._d2t[2]

    def visibility(self, parents: np.ndarray, depths: np.ndarray, start: int, device: torch.device):
        ancestors = torch.from_numpy(ancestor_matrix(parents, depths)) if len(parents) > 1 else None
        return ancestors, torch.from_numpy(depths + start)

    def greedy_walk(self, tree, ancestors, logits: torch.Tensor):
        return walk(tree, None, self._copy_back(logits.argmax(dim=-1))[0])
