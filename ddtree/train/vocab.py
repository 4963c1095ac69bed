"""A reduced draft vocabulary: the target's most frequent response tokens.

A drafter's LM head over the full vocabulary (49,152 rows for SmolLM2) is most of a small drafter's pass; the
target's own answers use far fewer distinct tokens. The drafter predicts over the `size` most frequent ones
(EAGLE-3's and vLLM's convention: config `draft_vocab_size`, its own `lm_head.weight` [size, H] initialized
from the target's head rows, `d2t` offsets with target id = draft id + d2t[draft id]). Losslessness does not
depend on it (the target verifies every draft token); a token outside the draft vocabulary simply cannot be
drafted.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..models.drafter import DFlashDrafter
from ..models.protocol import reference
from .data import Sequence


def response_token_counts(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the responses. Returns int64 [vocab_size]."""
    ids = torch.tensor([t for s in seqs for t in s.tokens[s.prompt_len:]], dtype=torch.long)
    return torch.bincount(ids, minlength=vocab_size)


def draft_vocabulary(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """The `size` most frequent ids (ties: the lower id), `always` included (e.g. the stop tokens), in
    ascending id order. Returns int64 [size]."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be within 1..{counts.numel()}, got {size}")
    score = counts.double().clone()
    score[list(always)] = float("inf")
    order = torch.sort(-score, stable=True).indices  # descending counts, lower id first among equals
    return order[:size].sort().values


def coverage(ids: torch.Tensor, seqs: list[Sequence]) -> float:
    """Fraction of the response tokens of `seqs` that the vocabulary `ids` holds."""
    tokens = torch.tensor([t for s in seqs for t in s.tokens[s.prompt_len:]], dtype=torch.long)
    return float(torch.isin(tokens, ids).double().mean()) if tokens.numel() else 0.0


def with_draft_vocab(drafter, ids: torch.Tensor, head_weight: torch.Tensor):
    """A copy of `drafter` predicting over the draft vocabulary `ids`: the same layers, its own head made of
    the rows `ids` of `head_weight` [V, H] (the target's LM head). A Markov head is left out: it reads the old
    draft vocabulary."""
    drafter = reference(drafter)
    cfg = replace(drafter.cfg, draft_vocab_size=int(ids.numel()), markov=None)
    new = DFlashDrafter(cfg, drafter.attention_backend)
    own = {k: v for k, v in drafter.state_dict().items()
           if k not in ("lm_head.weight", "d2t") and not k.startswith("markov.")}
    missing, unexpected = new.load_state_dict(own, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight", "d2t"}, (missing, unexpected)
    new = new.to(drafter.fc.weight.device, drafter.fc.weight.dtype)
    new.set_draft_vocab(ids, head_weight)
    if drafter._target:
        new.bind(drafter.target)
    return new
