"""What the decoding loop, the drafter and the tools may ask of a target (Target), of a drafter (Drafter), and of the
step's host operations (StepOps).

Target is implemented by the own-code model (ddtree.models.target.TargetModel), the generic transformers backend
(ddtree.models.hf_target.HFTarget) and the runtimes around the own-code model (ddtree/runtime/cpu, ddtree/runtime/gpu);
Drafter by the reference DFlashDrafter (ddtree.models.drafter) and the runtimes around it. Nothing outside a model's own
module asks it anything else: which fast paths it runs is its own business, and what of them matters to others (the
verify-cost curve's key, the stats) comes from `describe()`. A runtime is a plain object that implements the protocol
itself and holds its reference model as `.model` (reference() below): training, saving and weight surgery go there.
A test plants an oracle by setting `draft` on a drafter instance (every drafter is a plain object: the instance
attribute shadows the method).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn


def reference(model) -> nn.Module:
    """The reference module a loaded model runs: a runtime's `.model`, or the model itself when it is one (a target
    or drafter no runtime wraps). What to train, save, export or change the weights of."""
    return model if isinstance(model, nn.Module) else model.model


@dataclass
class TargetOutput:
    logits: "torch.Tensor | RowLogits"  # [N, V] ([1, V] with last_only; RowLogits with row_logits=True)
    taps: torch.Tensor | None  # [N, len(tap_layers) * hidden]: the drafter's context features


class RowLogits:
    """A verify pass's logits, computed only for the rows asked for: `logits[i:i + 1]` -> [1, V] through the
    target's LM head one row at a time, `logits[:]` -> all [N, V]. Why: a tree walk reads the target's choice
    only at the nodes on its path (about tau of them), and where the head's 1-row pass streams its weight while
    all N rows cost compute, reading rows lazily is cheaper (Target.lazy_logits decides)."""

    def __init__(self, target: "Target", hidden: torch.Tensor):
        self.target, self.hidden = target, hidden  # hidden: final-normed [N, H]
        self.shape = (hidden.shape[0], target.cfg.vocab_size)

    @torch.inference_mode()  # read after the pass, outside its inference mode; hidden is an inference tensor
    def __getitem__(self, rows) -> torch.Tensor:
        if not isinstance(rows, slice):
            raise TypeError("RowLogits are read by row slices, e.g. logits[i:i + 1] or logits[:]")
        return self.target.logits(self.hidden[rows])


class Target(Protocol):
    """A target model as the decoding loop and the drafter use it (batch size 1; N new tokens per pass)."""
    cfg: object  # ddtree.base.config.ModelConfig (or the HF backend's view of its config): shapes, vocab, context
    backend: str  # "own", or "hf:<the model's attention implementation>"
    attention_backend: str  # ddtree's attention for passes over this target's cache ("sdpa" / "triton")
    quant: str | None  # the block formats its linear layers run on (quant="gguf"), or None
    step_ops: "StepOps | None"  # the step's host operations its runtime supplies (chosen at load); None: the engine's
    host_inputs: bool  # its passes take a step's tokens, positions and visibility from the host (one upload each)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element type of new_cache()'s K/V: its dtype, or fp16 in the CPU integer mode (widened when read)."""

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, vis, tap_layers: tuple[int, ...] = (),
                 last_only: bool = False, row_logits: bool = False) -> TargetOutput:
        """One pass over tokens [N] at positions [N], writing their K/V to the cache without committing them."""

    def new_cache(self, capacity: int):
        """An empty KV cache for `capacity` positions (commit / room / length, as ddtree.models.kv_cache.KVCache)."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> embeddings [N, H] (the drafter shares them)."""

    def embed_table(self) -> torch.Tensor:
        """The table [V, H] whose rows embed() returns (a CPU drafter's one-call draft gathers them itself)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] -> logits [N, V] (the drafter shares the LM head)."""

    def lazy_logits(self, rows: int) -> bool:
        """Should a verify of `rows` nodes return RowLogits (forward(row_logits=True))?"""

    def refresh(self) -> "Target":
        """Re-make any copies of its weights from their current values (after writes torch does not count)."""

    def check_fresh(self) -> None:
        """A ConfigError where its copies of the weights are known to be stale (refresh() mends it)."""

    def describe(self) -> dict:
        """What, beyond its shape, dtype and device, sets the cost of its passes: the fast paths it runs
        (part of the verify-cost curve's key). Empty where nothing does."""


class Drafter(Protocol):
    """A DFlash drafter as the decoding loop uses it, bound to its target (batch size 1)."""
    cfg: object  # ddtree.models.drafter.DrafterConfig
    label: str  # what the stats call it: "shipped", "untrained" or the path it was loaded from

    @property
    def target(self) -> Target: ...

    @property
    def block_size(self) -> int: ...

    @property
    def markov(self):
        """Its Markov head (ddtree/models/markov.py: parent-conditioned trees), or None."""

    @property
    def d2t(self) -> torch.Tensor:
        """With a reduced draft vocabulary: draft id j is target id j + d2t[j] (LongTensor [draft vocab])."""

    def new_cache(self, capacity: int):
        """An empty context cache (ddtree.models.kv_cache.ContextCache)."""

    def add_context(self, cache, features: torch.Tensor) -> None:
        """Queue (a ContextCache) or compute (any other cache) the context K/V of the next n committed tokens from
        the target's tap features [n, taps * H]."""

    def flush_context(self, cache) -> None:
        """Compute the queued context now."""

    def draft(self, cache, bonus: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """One block pass from the bonus token [1]: logits [length - 1, draft vocab] for block positions 1..length-1."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, H] -> logits over the draft vocabulary."""

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> the target's token ids."""

    def refresh(self) -> "Drafter": ...

    def check_fresh(self) -> None: ...

    def describe(self) -> dict:
        """What sets its draft pass's cost beyond its shape: {"storage": what a pass streams of its layers' weights}."""


class StepOps(Protocol):
    """A speculative step's host operations, one object chosen at load by the target's runtime (ddtree/runtime):
    the engine's reference ones in numpy / torch (ddtree.engine.step_ops), or a CPU runtime's in its C++ kernel
    (ddtree.runtime.cpu.step_ops, the same results); for a target that takes host inputs, the engine's staged ones
    (ddtree.engine.staged_ops). The engine asks no model how to do these."""

    def root(self, token: int, device: torch.device) -> torch.Tensor:
        """A step's root, the last committed token, as a LongTensor [1] where these operations keep a tree's tokens."""

    def path_rows(self, path: list[int], device: torch.device) -> torch.Tensor:
        """The accepted path's node indices as a LongTensor on `device` (the rows a commit keeps)."""

    def tree_nodes(self, drafter: Drafter, logprobs: torch.Tensor, bonus: torch.Tensor, budget: int) -> tuple:
        """A draft's best-first nodes from its log-probs [depth, draft vocab]: (parents [n + 1], depths [n + 1] as
        numpy int64, draft ids LongTensor [n], path log-probs [n] as numpy), n <= budget, in pop order (any prefix
        is a tree); from each node's own conditional where the drafter has a Markov head."""

    def chain_ids(self, drafter: Drafter, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """A linear draft's ids [length - 1]: each position's argmax (given the token before it, with a Markov head)."""

    def tree_tokens(self, drafter: Drafter, bonus: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The tree's tokens [n + 1] in the target's vocabulary: the root bonus [1], then the draft ids [n]."""

    def visibility(self, parents: np.ndarray, depths: np.ndarray, start: int,
                   device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The verify pass's ancestor mask (bool [N, N]; None for a lone root) and positions [N] after `start`."""

    def greedy_walk(self, tree, ancestors, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Greedy acceptance over all N nodes' logits [N, V]: (the accepted path's node indices, the target's
        choice at each node) as tree.walk returns them."""
