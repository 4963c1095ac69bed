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


def pruned_draft_vocab(drafter, keep: torch.Tensor):
    """A copy of `drafter` (with a reduced draft vocabulary) predicting over its draft ids `keep` [n] (distinct, in
    ascending order): the same layers, the rows `keep` of its own trained head, d2t for their target ids, and a
    Markov head's columns `keep`. Its logits are the drafter's columns `keep`, so its trees are the drafter's with
    the other tokens never drafted: a smaller head for the same drafts wherever the kept tokens carry them (`train
    prune-vocab` keeps the most frequent response tokens)."""
    drafter = reference(drafter)
    if not drafter.cfg.reduced_vocab:
        raise ValueError("pruned_draft_vocab: the drafter predicts over the target's whole vocabulary (no draft "
                         "vocabulary of its own to prune); `train fit --draft-vocab N` makes one")
    keep = keep.to(torch.long).cpu()
    n = drafter.cfg.draft_vocab_size
    if keep.dim() != 1 or not 1 <= keep.numel() <= n or not bool((keep[1:] > keep[:-1]).all()) or \
            int(keep[0]) < 0 or int(keep[-1]) >= n:
        raise ValueError(f"pruned_draft_vocab: keep must be distinct draft ids in ascending order within 0..{n - 1}")
    cfg = replace(drafter.cfg, draft_vocab_size=int(keep.numel()))
    new = DFlashDrafter(cfg, drafter.attention_backend)
    state = drafter.state_dict()
    device = drafter.fc.weight.device
    rows = keep.to(device)
    state["lm_head.weight"] = state["lm_head.weight"][rows]
    state["d2t"] = drafter.to_target_ids(rows) - torch.arange(keep.numel(), device=device)
    if drafter.markov is not None:
        state["markov.out"] = state["markov.out"][:, rows]
    new.load_state_dict(state)
    new = new.to(device, drafter.fc.weight.dtype)
    if drafter._target:
        new.bind(drafter.target)
    return new
