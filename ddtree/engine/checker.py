"""Losslessness checking: a method's tokens against plain decoding's, with tie flips told apart from errors.

A verify pass computes the same logits as plain decoding only up to floating-point rounding (other query
lengths take other kernel paths). At the first position where two greedy outputs differ, the divergence is
a TIE FLIP when plain decoding's own top-2 logit margin there is within the dtype's rounding noise, and an
ERROR otherwise. Errors fail; tie flips are counted and reported.

After a tie flip the two outputs continue from different prefixes, so comparing them further means nothing;
instead every later token of the method must be the target's own greedy choice given the method's own prefix
(within the same tolerance), checked on one teacher-forced pass. An error after a flip cannot hide behind it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Rounding-noise allowance, in units of the dtype's machine epsilon times the top logit's magnitude.
# Logits pass through every layer, so the noise is many ulps; these bounds are deliberately loose for the
# low-precision types and tight for fp32 (where a flip is essentially never legitimate).
NOISE_ULPS = {torch.float32: 512.0, torch.bfloat16: 8.0, torch.float16: 16.0}


def tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    return NOISE_ULPS.get(dtype, 8.0) * torch.finfo(dtype).eps * max(1.0, abs(top_logit))


@dataclass
class Verdict:
    kind: str  # "identical", "tie_flip" or "error"
    position: int | None = None  # index into the generated tokens of the first divergence
    reference_token: int | None = None
    method_token: int | None = None
    margin: float | None = None  # top-1 minus top-2 logit at a first divergence; after a flip, top-1 minus the token's
    tolerance: float | None = None

    @property
    def ok(self) -> bool:
        return self.kind != "error"

    def describe(self) -> str:
        if self.kind == "identical":
            return "identical"
        return (f"{self.kind} at generated token {self.position}: reference {self.reference_token}, method "
                f"{self.method_token}, reference top-2 margin {self.margin:.3g} (tie tolerance {self.tolerance:.3g})")


def check_tokens(reference: list[int], tokens: list[int], logits_at: Callable[[int], torch.Tensor],
                 dtype: torch.dtype, own_logits: Callable[[], torch.Tensor] | None = None) -> Verdict:
    """Compare greedy outputs. logits_at(i) returns the target's logits [V] for predicting generated token i
    given the prompt and reference[:i] (used only when the outputs differ). own_logits() returns the target's
    logits [len(tokens), V] for each of the method's tokens given the prompt and the method's own earlier
    tokens; with it, the tokens after a tie flip are checked too."""
    n = min(len(reference), len(tokens))
    first = next((i for i in range(n) if reference[i] != tokens[i]), None)
    if first is None:
        if len(reference) == len(tokens):
            return Verdict("identical")
        # One stopped earlier with the same prefix: only a divergence in stop decisions could do that.
        return Verdict("error", n, reference[n] if n < len(reference) else None,
                       tokens[n] if n < len(tokens) else None, float("nan"), 0.0)
    logits = logits_at(first).float()
    top2 = logits.topk(2).values
    margin = float(top2[0] - top2[1])
    tol = tie_tolerance(dtype, float(top2[0]))
    if margin > tol:
        return Verdict("error", first, reference[first], tokens[first], margin, tol)
    if own_logits is not None and first + 1 < len(tokens):
        own = own_logits()[first + 1:len(tokens)].float()  # [rest, V]
        top = own.max(dim=-1).values
        chosen = own.gather(1, torch.tensor(tokens[first + 1:], device=own.device)[:, None])[:, 0]
        shortfall = top - chosen  # 0 where the method took the argmax
        tols = torch.tensor([tie_tolerance(dtype, float(t)) for t in top], device=own.device)
        bad = torch.nonzero(shortfall > tols).flatten()
        if len(bad):  # reference_token: the target's own choice there; margin: how far below it the method's token is
            i = int(bad[0])
            return Verdict("error", first + 1 + i, int(own[i].argmax()), tokens[first + 1 + i], float(shortfall[i]),
                           float(tols[i]))
    return Verdict("tie_flip", first, reference[first], tokens[first], margin, tol)
