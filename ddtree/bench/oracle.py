"""Oracle drafts at a controlled acceptance, for timing the engine on shapes without a trained drafter (the GPU
benchmark's Qwen3-8B-shaped target, scripts/gpu_e2e.py).

A block drafter drafts every depth in one pass, without knowing which token stood at the depth before: on the spine
(the parent was its top-1) it is usually right, after a sibling (the parent ranked 2nd-4th) much less often. An
oracle that ignores this flatters trees, whose extra nodes are exactly the siblings' subtrees. Here the rank of the
true token at each depth is drawn from a preset's rates given the rank of the true token at the depth before, the
same split the probe measures on a real drafter (ddtree/train/probe.py, path_hits), and the logits are built to
rank it there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K = 4  # a parent ranked below TOP_K (FAR) ends the path: no tree of a useful budget holds it
FAR = 10**6  # the rank recorded for a true token outside the top TOP_K


@dataclass(frozen=True)
class OraclePreset:
    """Per depth (1, 2, ...; past the table the last entry holds): (P[true token top-1], P[true token in the top
    TOP_K]) after a spine parent (depth 1: after the bonus token, which is always right) and after a sibling
    parent (depth 1 has none). `split`: how a rank in 2..TOP_K divides among 2nd, 3rd, 4th. `calibrated`: the
    drafted probabilities of the top TOP_K ranks are the spine's rates (what a tree builder is told), else fixed
    logit gaps of 1 (the first oracle's)."""
    name: str
    spine: tuple[tuple[float, float], ...]
    sibling: tuple[tuple[float, float], ...]
    split: tuple[float, float, float]
    source: str
    calibrated: bool = True

    def rates(self, depth: int, after_sibling: bool) -> tuple[float, float]:
        table = self.sibling if after_sibling else self.spine
        return table[min(depth, len(table)) - 1]

    def rank_probs(self, depth: int) -> list[float]:
        """The drafted probability of ranks 0..TOP_K-1 and of all the rest, at this depth (the spine's rates)."""
        top1, topk = self.rates(depth, after_sibling=False)
        return [top1] + [(topk - top1) * share for share in self.split] + [1.0 - topk]


PRESETS = {p.name: p for p in (
    OraclePreset(
        "optimistic", spine=((0.8, 1.0),), sibling=((0.8, 1.0),), split=(0.5, 0.5, 0.0), calibrated=False,
        source="the benchmark's first oracle: top-1 with p 0.8, else 2nd or 3rd, whatever the parent (siblings are "
               "right as often as the spine)"),
    OraclePreset(
        "embedded",
        spine=((0.693, 0.85), (0.66, 0.83), (0.62, 0.81), (0.58, 0.80), (0.55, 0.82), (0.54, 0.83), (0.54, 0.84)),
        sibling=((0.34, 0.61), (0.34, 0.61), (0.30, 0.59), (0.30, 0.62), (0.28, 0.61), (0.31, 0.64), (0.29, 0.65)),
        split=(0.5, 0.3, 0.2),
        source="the shipped SmolLM2 drafter's probe (40,621 roots of held-out and evaluation answers, 2026-11-27; "
               "ddtree/train/RECIPE.md): depths 2-7 measured; depth 1's top-1 is the roots' first-position top-1, "
               "its top-4 and the 2nd/3rd/4th split assumed"),
    OraclePreset(
        "qwen3-8b-dflash", spine=((0.86, 0.97),), sibling=((0.22, 0.45),), split=(0.5, 0.3, 0.2),
        source="published Qwen3-8B DFlash acceptance: a block-16 chain's tau ~6.5 (spine top-1 0.86 at every "
               "depth gives 6.5) and ~22% right after an accepted sibling (an independent vLLM study); the top-4 "
               "rates and the split assumed"),
)}


def sample_ranks(preset: OraclePreset, depths: int, generator: torch.Generator) -> list[int]:
    """The true token's rank (0-based; FAR outside the top TOP_K) at block depths 1..depths, each drawn given the
    rank at the depth before (a Markov chain: spine parent, sibling parent, or a dead path, drawn as a sibling)."""
    ranks, parent = [], 0
    u = torch.rand(depths, 2, generator=generator, dtype=torch.float64).tolist()
    for depth in range(1, depths + 1):
        top1, topk = preset.rates(depth, after_sibling=parent != 0)
        a, b = u[depth - 1]
        if a < top1:
            rank = 0
        elif a < topk:
            c = 0.0
            for rank, share in enumerate(preset.split, start=1):
                c += share
                if b < c:
                    break
        else:
            rank = FAR
        ranks.append(rank)
        parent = rank
    return ranks


def rank_table(preset: OraclePreset, chains: int, depths: int, generator: torch.Generator, device) -> torch.Tensor:
    """sample_ranks drawn `chains` times: int64 [chains, depths] on `device`, uploaded once, so that a timed draft
    reads its ranks there (a row per draft) instead of copying them from the host (a synchronization)."""
    return torch.tensor([sample_ranks(preset, depths, generator) for _ in range(chains)], device=device)


def prob_table(preset: OraclePreset, depths: int, device) -> torch.Tensor | None:
    """OraclePreset.rank_probs at depths 1..depths: float32 [depths, TOP_K + 1] on `device` (None when the preset
    is not calibrated); a draft of n positions takes the first n rows."""
    if not preset.calibrated:
        return None
    return torch.tensor([preset.rank_probs(d) for d in range(1, depths + 1)], device=device)


def oracle_logits(truth: torch.Tensor, ranks, vocab: int, generator: torch.Generator,
                  probs: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [n, vocab] (float32, on truth's device) ranking truth[i] at ranks[i] (a list, or an int64 tensor on
    truth's device: rank_table's row): noise N(0, 1) everywhere, distinct decoys (never the true token) at the other
    top TOP_K ranks, and a FAR true token below all the noise. probs [n, TOP_K + 1] (prob_table's rows): the top
    ranks' softmax probabilities, the noise holding the rest (with vocabularies of thousands, so that no noise
    outranks the top ranks); None: scores 14 - rank. Everything runs on the device: no synchronization."""
    n, dev = truth.numel(), truth.device
    logits = torch.randn(n, vocab, generator=generator, device=dev)
    rows = torch.arange(n, device=dev)
    # TOP_K consecutive offsets from a random start in [1, vocab - TOP_K]: distinct decoys, none the true token
    start = torch.randint(1, vocab - TOP_K + 1, (n, 1), generator=generator, device=dev)
    decoys = (truth[:, None] + start + torch.arange(TOP_K, device=dev)) % vocab  # [n, TOP_K]
    rank = torch.as_tensor(ranks, device=dev).clamp(max=TOP_K)  # FAR -> TOP_K: the decoys take ranks 0..TOP_K-1
    # decoy `slot` takes rank slot, or slot + 1 at and past the true token's rank; TOP_K: not needed, stays noise
    at = torch.arange(TOP_K, device=dev) + (torch.arange(TOP_K, device=dev) >= rank[:, None]).long()  # [n, TOP_K]
    tokens = torch.cat([decoys, truth[:, None]], dim=1)  # [n, TOP_K + 1] and the rank each takes (TOP_K: none)
    places = torch.cat([at, rank[:, None]], dim=1)
    if probs is None:
        scores = 14.0 - places.float()
    else:  # the tokens that stay noise hold probs[:, TOP_K] between them
        probs = probs.to(dev, torch.float32)
        noise = logits.clone()
        held = (places < TOP_K) | (torch.arange(TOP_K + 1, device=dev) == TOP_K)  # placed, or the true token
        noise[rows[:, None], tokens] = torch.where(held, float("-inf"), noise[rows[:, None], tokens])
        scale = torch.logsumexp(noise, dim=1) - probs[:, TOP_K].log()
        scores = scale[:, None] + probs.log().gather(1, places.clamp(max=TOP_K - 1))
    placed = torch.where(places < TOP_K, scores, logits[rows[:, None], tokens])
    placed[:, TOP_K] = torch.where(rank < TOP_K, placed[:, TOP_K], -30.0)  # a FAR true token: below all the noise
    logits[rows[:, None], tokens] = placed
    return logits
