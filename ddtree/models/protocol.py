"""What the decoding loop, the drafter and the tools may ask of a target: the one interface that the own-code
model (ddtree.models.target.TargetModel) and the generic transformers backend (ddtree.models.hf_target.HFTarget) implement.

Nothing outside a target's own module asks it anything else: which fast paths it runs is its own business, and
what of them matters to others (the verify-cost curve's key, the stats) comes from `describe()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, vis, tap_layers: tuple[int, ...] = (),
                 last_only: bool = False, row_logits: bool = False) -> TargetOutput:
        """One pass over tokens [N] at positions [N], writing their K/V to the cache without committing them."""

    def new_cache(self, capacity: int):
        """An empty KV cache for `capacity` positions (commit / room / length, as ddtree.models.kv_cache.KVCache)."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> embeddings [N, H] (the drafter shares them)."""

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
