"""Losslessness checking: a method's tokens against plain decoding's, with tie flips told apart from errors.

A verify pass computes the same logits as plain decoding only up to floating-point rounding (other query
lengths take other kernel paths). At the first position where two greedy outputs differ, the divergence is
a TIE FLIP when plain decoding's own top-2 logit margin there is within the dtype's rounding noise, and an
ERROR otherwise. Errors fail; tie flips are counted and reported.
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
    margin: float | None = None  # plain decoding's top-1 minus top-2 logit at the divergence
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
                 dtype: torch.dtype) -> Verdict:
    """Compare greedy outputs. logits_at(i) returns the target's logits [V] for predicting generated token i
    given the prompt and reference[:i] (used only when the outputs differ)."""
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
    kind = "tie_flip" if margin <= tol else "error"
    return Verdict(kind, first, reference[first], tokens[first], margin, tol)
