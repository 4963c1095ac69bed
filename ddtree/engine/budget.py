"""Adaptive DDTree budget: each step verifies the tree size that maximizes expected tokens per second.

For the best-first pop order p_1 >= p_2 >= ... (p_i = the drafter's probability that node i's whole path is
accepted), a tree of the first b nodes accepts 1 + sum_{i<=b} p_i tokens in expectation (bonus included), and
a step that verifies it costs fixed + verify(b + 1) seconds. So

    b* = argmax_b (1 + cumsum(p)[b]) / (fixed + verify(b + 1))

computed per step from that step's own draft: a confident draft gets a deep narrow tree, a diffuse one a small
tree (or just the root's best child). Any b is a valid tree, so this stays lossless by construction.
verify(n) comes from a calibration run of the target at start-up (`calibrate`), cached per process. The
drafter's probabilities are trusted only as far as they have proved right: `EdgeCalibration` scales every
edge by a factor learned online from accepted vs predicted lengths (a random drafter, confidently wrong,
is driven to one-node trees within a few steps), and `DraftGate` skips the drafter altogether while
drafted steps are slower than plain ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..models.attention import Visibility
from .tree import ancestor_matrix, chain_parents

# every size up to 6 and some beyond: a CPU kernel's cost steps where its passes change shape (6 rows on AVX2, 13 with
# AVX-512; qlinear.cpp), which interpolating between 4 and 8 nodes misread by up to 15%
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class CostModel:
    """Seconds per decoding step: fixed (draft, tree build, commit) + verify(n nodes), piecewise linear."""
    sizes: tuple[int, ...]  # node counts measured, root included, increasing
    verify_seconds: tuple[float, ...]
    fixed_seconds: float  # with a draft of the whole block
    draft_seconds: tuple[float, ...] = ()  # the draft pass at lengths 2, 3, ..., block; () = not measured

    def __post_init__(self):
        if len(self.sizes) != len(self.verify_seconds) or not self.sizes:
            raise ValueError("CostModel needs one verify time per size")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"CostModel sizes must be strictly increasing, got {self.sizes}")

    def fixed(self, length: int | None = None) -> float:
        """fixed_seconds for a draft of `length` positions (None: the whole block), scaled by the measured draft
        passes (on a CPU their rows are compute-bound: 3 positions cost about half of 8)."""
        if length is None or not self.draft_seconds:
            return self.fixed_seconds
        i = min(max(length, 2), len(self.draft_seconds) + 1) - 2
        return self.fixed_seconds * self.draft_seconds[i] / self.draft_seconds[-1]

    def step_seconds(self, nodes: np.ndarray, length: int | None = None) -> np.ndarray:
        """Seconds of a step verifying `nodes` nodes (root included) after a draft of `length` positions (None:
        the whole block); linear beyond the last size."""
        nodes = np.asarray(nodes, dtype=np.float64)
        s, v = np.asarray(self.sizes, dtype=np.float64), np.asarray(self.verify_seconds)
        out = np.interp(nodes, s, v)
        if len(s) > 1:  # extrapolate with the last segment's slope
            slope = (v[-1] - v[-2]) / (s[-1] - s[-2])
            out = np.where(nodes > s[-1], v[-1] + slope * (nodes - s[-1]), out)
        return self.fixed(length) + out


def choose_budget(path_logprobs: np.ndarray, cost: CostModel, depths: np.ndarray | None = None,
                  edge_scale: float = 1.0, length: int | None = None) -> int:
    """The number of best-first nodes (>= 1) that maximizes expected accepted tokens per second. With depths
    [len] and edge_scale c, a node's acceptance probability is taken as p * c**depth (see EdgeCalibration).
    length: the draft's positions (its cost is in every step; None: the whole block)."""
    if len(path_logprobs) == 0:
        raise ValueError("no draft nodes to choose from")
    p = np.exp(path_logprobs)
    if depths is not None and edge_scale != 1.0:
        p = p * edge_scale ** np.asarray(depths, dtype=np.float64)
    expected = 1.0 + np.cumsum(p)  # tokens per step for b = 1..len
    rate = expected / cost.step_seconds(np.arange(2, len(path_logprobs) + 2), length)
    return int(np.argmax(rate)) + 1


@dataclass
class DraftGate:
    """Whether drafting pays at all: compares the realized speed of drafted steps (EMA of tokens per modeled
    second) with plain decoding's 1 / verify(1). While drafting loses, steps skip the drafter (an `ar` step
    on the same loop) except one exploring step, which keeps the estimate fresh: first after
    `explore_every` steps, then after twice as many each time drafting still loses (up to `max_interval`);
    each new prompt (`restart`) starts that schedule again, and an exploring step weighs `explore_alpha` in
    the estimate, so a prompt where drafting pays is found within a few steps even after many where it did
    not. With a useless drafter the method so stays within a few percent of `ar`: on the 2-core AVX2 CPU an
    exploring step costs ~1.5-3 plain ones; 1 in 8 cost ~5-20%, 3 per 64-token prompt ~2%."""
    explore_every: int = 8
    max_interval: int = 64
    alpha: float = 0.1  # per drafted step: single steps are noisy (1 to block tokens); 0.2 measured worse
    explore_alpha: float = 0.5
    rate: float | None = None  # EMA of tokens / modeled second over drafted steps
    skipped: int = 0
    interval: int = 0  # plain steps between explorations now (explore_every .. max_interval)
    exploring: bool = False  # the current step explores

    def restart(self) -> None:
        """A new prompt: explore soon (what held for the last prompt may not hold here); the estimate stays."""
        self.skipped, self.interval = 0, self.explore_every

    def draft_now(self, cost: CostModel) -> bool:
        ar_rate = 1.0 / float(cost.step_seconds(np.array([1]))[0] - cost.fixed_seconds)
        self.exploring = False
        if self.rate is None or self.rate >= ar_rate:
            self.skipped, self.interval = 0, self.explore_every
            return True
        self.interval = self.interval or self.explore_every
        if self.skipped + 1 >= self.interval:  # explore; if it still loses, wait twice as long next time
            self.skipped, self.interval = 0, min(2 * self.interval, self.max_interval)
            self.exploring = True
            return True
        self.skipped += 1
        return False

    def update(self, tokens: int, seconds: float) -> None:
        r, a = tokens / seconds, self.explore_alpha if self.exploring else self.alpha
        self.rate = r if self.rate is None else (1 - a) * self.rate + a * r


@dataclass
class EdgeCalibration:
    """How far to trust the drafter's probabilities, learned online: each tree edge's probability is scaled by
    c in [0.01, 1], so a node at depth d counts p * c**d. A random or over-confident drafter (which predicts
    long accepted paths that never come) drives c down and the budget with it; a calibrated one keeps c ~ 1.
    After each step c moves by (accepted + 0.5) / (predicted + 0.5), spread over the predicted path depth."""
    c: float = 1.0

    def predicted(self, path_logprobs: np.ndarray, depths: np.ndarray) -> float:
        return float(np.sum(np.exp(path_logprobs) * self.c ** np.asarray(depths, dtype=np.float64)))

    def update(self, path_logprobs: np.ndarray, depths: np.ndarray, accepted: int) -> None:
        """accepted: draft tokens the target accepted this step (bonus excluded)."""
        predicted = self.predicted(path_logprobs, depths)
        mean_depth = max(1.0, predicted)  # the expected path length is about the predicted accepted count
        ratio = (accepted + 0.5) / (predicted + 0.5)
        self.c = float(np.clip(self.c * ratio ** (0.5 / mean_depth), 0.01, 1.0))


@torch.inference_mode()
def calibrate(target, drafter, context: int = 256, sizes=CALIBRATION_SIZES, repeats: int = 5,
              block_size: int | None = None, stop_when_hopeless: bool = True) -> CostModel:
    """Time the target's verify pass for each tree size (a chain: on these sizes the mask shape barely matters)
    after `context` committed tokens, and the drafter's pass at each length; per pass the median of `repeats`
    rounds over all of them, after a warm-up round.
    With stop_when_hopeless, sizes stop after the first whose step costs more than `block` plain steps: such a
    step loses to plain decoding even when the whole block is accepted, so no larger tree is worth timing (on
    a 2-core AVX2 CPU this skips the 128..512-node passes, seconds each)."""
    cfg, device = target.cfg, target.device
    limit = cfg.max_position_embeddings
    sizes = tuple(n for n in sizes if n < limit) or (1,)
    context = max(1, min(context, limit - max(sizes)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (context + max(sizes),), generator=gen).to(device)
    taps = tuple(drafter.cfg.target_layer_ids)
    cache = target.new_cache(context + max(sizes))
    out = target(ids[:context], torch.arange(context, device=device), cache, Visibility.causal(0, context, device),
                 taps, last_only=True)
    cache.commit(context)

    def once(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    block = block_size or drafter.block_size
    dcache = drafter.new_cache(context + max(block, max(sizes)))
    drafter.add_context(dcache, out.taps)
    bonus = ids[context:context + 1]
    passes = [lambda n=n: drafter.draft(dcache, bonus, n) for n in range(2, block + 1)]
    for fn in passes:  # warm-up
        fn()
    # + tree build, compile, walk and commit: a few ms on a CPU, well under a verify pass; 10% of the draft
    # pass stands in for them (the benchmark's stage times show the real split)
    fixed = once(passes[-1]) * 1.1
    for n in sizes:  # a first (warm-up) round, which also finds the sizes worth timing
        parents, depths = chain_parents(n)
        anc = torch.from_numpy(ancestor_matrix(parents, depths)).to(device) if n > 1 else None
        vis, pos = Visibility(context, anc), torch.arange(context, context + n, device=device)
        passes.append(lambda n=n, vis=vis, pos=pos: target(ids[context:context + n], pos, cache, vis, taps))
        passes[-1]()  # a first call may set up (a GPU runtime captures its graphs, Triton compiles): untimed
        seconds = once(passes[-1])
        if n == sizes[0]:
            first = seconds
        if stop_when_hopeless and sizes[0] == 1 and fixed + seconds > block * first:
            break
    # then `repeats` rounds over every pass in turn, so that a machine whose speed drifts (other processes, clock)
    # shifts all sizes alike instead of bending the curve: auto's choices rest on the ratios between sizes
    times = [[once(fn) for fn in passes] for _ in range(repeats)]
    medians = np.median(np.asarray(times), axis=0)
    drafts, verify = tuple(float(t) for t in medians[:block - 1]), medians[block - 1:]
    fixed = drafts[-1] * 1.1
    verify = tuple(float(t) for t in np.maximum.accumulate(verify))  # more nodes never cost less: noise does
    return CostModel(sizes[:len(verify)], tuple(verify), fixed, drafts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
