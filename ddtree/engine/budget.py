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

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.attention import Visibility
from .staged_ops import step_ops_for
from .tree import ancestor_matrix, chain_parents

# every size up to 6 and some beyond: a CPU kernel's cost steps where its passes change shape (6 rows on AVX2, 13 with
# AVX-512; qlinear.cpp), which interpolating between 4 and 8 nodes misread by up to 15%
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32, 64, 128, 256, 512)
# the verify passes are timed again after LONG_CONTEXT committed tokens, up to KEY_SIZES_MAX nodes (beyond, the
# per-token cost is extrapolated): what a longer context adds to each size (CostModel.key_seconds)
LONG_CONTEXT, KEY_SIZES_MAX = 1280, 64


@dataclass(frozen=True)
class CostModel:
    """Seconds per decoding step: fixed (draft, tree build, commit) + verify(n nodes), piecewise linear, after
    `context` committed tokens; with key_seconds, each committed token beyond that adds key_seconds(n) to a verify
    (its keys are read and weighed by every row: on a CPU an extra row costs several times more at 2,000 tokens
    than at 256, so a curve taken at one context over-values trees at long ones)."""
    sizes: tuple[int, ...]  # node counts measured, root included, increasing
    verify_seconds: tuple[float, ...]
    fixed_seconds: float  # with a draft of the whole block
    draft_seconds: tuple[float, ...] = ()  # the draft pass at lengths 2, 3, ..., block; () = not measured
    context: int = 0  # committed tokens the verify times were measured after
    key_seconds: tuple[float, ...] = ()  # per size (the first len(key_seconds) sizes): seconds per token of context

    def __post_init__(self):
        if len(self.sizes) != len(self.verify_seconds) or not self.sizes:
            raise ValueError("CostModel needs one verify time per size")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"CostModel sizes must be strictly increasing, got {self.sizes}")
        if len(self.key_seconds) > len(self.sizes):
            raise ValueError("CostModel needs at most one key_seconds per size")
        # verify(n) for n = 0 .. the last size, read by index each step (interpolating costs more than the rule);
        # also as Python lists, for the per-step rule (_verify_upto)
        nodes = np.arange(self.sizes[-1] + 1)
        object.__setattr__(self, "_table", self._verify(nodes))
        keys = _piecewise(nodes, self.sizes[:len(self.key_seconds)], self.key_seconds) if self.key_seconds else None
        object.__setattr__(self, "_key_table", keys)
        object.__setattr__(self, "_verify_list", self._table.tolist())
        object.__setattr__(self, "_key_list", None if keys is None else keys.tolist())

    def _verify(self, nodes: np.ndarray) -> np.ndarray:
        """verify(n): piecewise linear through the measured sizes, with the last segment's slope beyond them."""
        return _piecewise(nodes, self.sizes, self.verify_seconds)

    def _beyond(self, nodes: np.ndarray, context: int | None) -> np.ndarray | float:
        """What `context` committed tokens add to a verify of `nodes` over the measured curve (0 without a context
        model, or at a context no longer than the calibration's)."""
        if context is None or self._key_table is None or context <= self.context:
            return 0.0
        per_key = _lookup(self._key_table, nodes, self.sizes[:len(self.key_seconds)], self.key_seconds)
        return (context - self.context) * per_key

    @property
    def plain_seconds(self) -> float:
        """A plain step's verify: one node."""
        return self.plain_seconds_at(None)

    def plain_seconds_at(self, context: int | None) -> float:
        """A plain step's verify after `context` committed tokens (None: the calibration's context)."""
        return self._seconds_upto(1, 0.0, context)[0]

    def tree_step_seconds(self, count: int, length: int | None = None, context: int | None = None,
                          drafted: bool = True) -> list[float]:
        """step_seconds of trees of 0, 1, ..., count draft nodes (1 .. count + 1 nodes with the root), as Python
        floats: what the adaptive rule reads every step. drafted=False: a step without a draft pass (its nodes from
        elsewhere: a context lookup), the verify alone."""
        return self._seconds_upto(count + 1, self.fixed(length) if drafted else 0.0, context)

    def _seconds_upto(self, last: int, fixed: float, context: int | None) -> list[float]:
        """fixed + verify(n) + what `context` adds, for n = 1 .. last, in step_seconds' order of sums; without numpy
        where the measured curve covers them (numpy's per-call cost, larger right after a target pass has evicted its
        code from the caches, would be most of the rule's time)."""
        if last >= len(self._verify_list):
            nodes = np.arange(1, last + 1)
            return (fixed + self._verify(nodes) + self._beyond(nodes, context)).tolist()
        verify = self._verify_list[1:last + 1]
        if self._key_list is None or context is None or context <= self.context:
            return [fixed + v for v in verify]
        extra = context - self.context
        return [fixed + v + extra * k for v, k in zip(verify, self._key_list[1:last + 1])]

    def fixed(self, length: int | None = None) -> float:
        """fixed_seconds for a draft of `length` positions (None: the whole block), scaled by the measured draft
        passes (on a CPU their rows are compute-bound: 3 positions cost about half of 8)."""
        if length is None or not self.draft_seconds:
            return self.fixed_seconds
        i = min(max(length, 2), len(self.draft_seconds) + 1) - 2
        return self.fixed_seconds * self.draft_seconds[i] / self.draft_seconds[-1]

    def step_seconds(self, nodes: np.ndarray, length: int | None = None, context: int | None = None) -> np.ndarray:
        """Seconds of a step verifying `nodes` nodes (root included) after a draft of `length` positions (None:
        the whole block) with `context` tokens committed (None: the calibration's); linear beyond the last size."""
        nodes = np.asarray(nodes)
        verify = _lookup(self._table, nodes, self.sizes, self.verify_seconds)
        return self.fixed(length) + verify + self._beyond(nodes, context)


def _lookup(table: np.ndarray, nodes: np.ndarray, sizes, values) -> np.ndarray:
    """_piecewise(nodes, sizes, values), read from `table` (its values at 0, 1, ...) where every node count is in it."""
    inside = nodes.dtype.kind in "iu" and nodes.size and nodes.min() >= 0 and nodes.max() < len(table)
    return table[nodes] if inside else _piecewise(nodes, sizes, values)


def _piecewise(nodes: np.ndarray, sizes, values) -> np.ndarray:
    """values(n): piecewise linear through (sizes, values), with the last segment's slope beyond them."""
    nodes = np.asarray(nodes, dtype=np.float64)
    s, v = np.asarray(sizes, dtype=np.float64), np.asarray(values, dtype=np.float64)
    out = np.interp(nodes, s, v)
    if len(s) > 1:
        slope = (v[-1] - v[-2]) / (s[-1] - s[-2])
        out = np.where(nodes > s[-1], v[-1] + slope * (nodes - s[-1]), out)
    return out


def choose_budget(path_logprobs, cost: CostModel, depths=None, edge_scale: float = 1.0, length: int | None = None,
                  context: int | None = None, chain_added: list[int] | None = None, chain_yield: float = 0.0,
                  row_scale: float = 1.0) -> int:
    """The number of best-first nodes (>= 1) that maximizes expected accepted tokens per second. path_logprobs
    [n] and depths [n] (numpy arrays or lists): with depths and edge_scale c, a node's acceptance probability is
    taken as p * c**depth (see EdgeCalibration). length: the draft's positions (its cost is in every step; None:
    the whole block); context: the committed tokens (None: the calibration's). chain_added [n + 1]: a lookup chain
    grafted after the b nodes appends chain_added[b] more (tree.chain_added), each worth chain_yield tokens, so the
    drafter's nodes are weighed on top of the chain's rows, not on an empty tree's (on a CPU the cost curve steeps
    with the rows). row_scale: what the rows beyond the root cost against the curve's price (RowCostFeedback). One
    pass in Python floats over the nodes (a handful on a CPU: numpy's per-call cost would be most of the step's
    host time)."""
    n = len(path_logprobs)
    if n == 0:
        raise ValueError("no draft nodes to choose from")
    extra = chain_added or [0] * (n + 1)
    # [n + extra[0] + 1]: a tree of b nodes is b + 1 rows with the root (b + extra[b] <= n + extra[0])
    seconds = cost.tree_step_seconds(n + extra[0], length, context)
    if row_scale != 1.0:
        seconds = [seconds[0] + row_scale * (t - seconds[0]) for t in seconds]
    expected, best, best_rate = 1.0, 1, -1.0
    for b, p in enumerate(node_probabilities(path_logprobs, depths, edge_scale), start=1):
        expected += p
        rate = (expected + chain_yield * extra[b]) / seconds[b + extra[b]]
        if rate > best_rate:
            best, best_rate = b, rate
    return best


def node_probabilities(path_logprobs, depths=None, edge_scale: float = 1.0) -> list[float]:
    """Each best-first node's acceptance probability as the rules take it, p * c**depth (EdgeCalibration's c), as
    Python floats; path_logprobs [n] and depths [n] are numpy arrays or lists."""
    logp = _as_list(path_logprobs)
    if depths is None or edge_scale == 1.0:
        return [math.exp(lp) for lp in logp]
    depth_list = _as_list(depths)
    powers = [edge_scale ** d for d in range(max(depth_list, default=0) + 1)]
    return [math.exp(lp) * powers[d] for lp, d in zip(logp, depth_list)]


def _as_list(values) -> list:
    """A numpy array or a sequence as a list of Python numbers (what the per-step rules loop over)."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


@dataclass
class RowCostFeedback:
    """What a tree's rows cost on this run against the curve's price, learned from the drafted steps themselves.
    The curve is taken in a second or two at start-up and cached per machine; on a shared VM it can price the rows
    beyond the root at half what decoding then pays, and `auto` keeps nodes that do not pay for themselves.

    Each drafted step gives the curve's price of its rows beyond the root, x = verify(rows) - verify(1), and the
    step's verify seconds, y (its stage timer's: the whole step's wall time adds the draft's and the host's noise,
    which hid the slope). A least-squares line y = a + s x over the recent steps (each weighed `decay` per step since)
    gives s, the scale choose_budget puts on those prices (row_scale): the line's slope averaged with `prior`
    steps' worth of the curve's own (s = 1), kept while the steps' prices vary too little to tell a slope (by less
    than `min_spread` of their mean), and inside `limits`. The intercept takes what the curve misprices in every
    verify alike."""
    decay: float = 0.98
    prior: float = 4.0
    min_spread: float = 0.05
    limits: tuple[float, float] = (0.5, 4.0)
    scale: float = 1.0  # s
    sums: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0, 0.0)  # weighted count, x, y, x * x, x * y

    def update(self, priced: float, seconds: float) -> None:
        """priced: the curve's price of the step's rows beyond the root (x); seconds: the step's verify time (y)."""
        d = self.decay
        w, sx, sy, sxx, sxy = (d * v for v in self.sums)
        w, sx, sy, sxx, sxy = w + 1, sx + priced, sy + seconds, sxx + priced * priced, sxy + priced * seconds
        self.sums = (w, sx, sy, sxx, sxy)
        mx, my = sx / w, sy / w
        spread, covariance = sxx - w * mx * mx, sxy - w * mx * my  # w times the variance of x, the covariance
        if spread <= w * (self.min_spread * mx) ** 2:
            return
        slope = (w * covariance / spread + self.prior) / (w + self.prior)
        self.scale = min(max(slope, self.limits[0]), self.limits[1])


@dataclass
class DraftGate:
    """Whether drafting pays at all: compares the realized speed of drafted steps (EMA of tokens per modeled
    second) with plain decoding's 1 / verify(1). While drafting loses, steps skip the drafter (an `ar` step
    on the same loop) except one exploring step, which keeps the estimate fresh: first after
    `explore_every` steps, then after twice as many each time drafting still loses (up to `max_interval`);
    each new prompt (`restart`) starts that schedule again, and an exploring step weighs `explore_alpha` in
    the estimate, so a prompt where drafting pays is found within a few steps even after many where it did
    not. With a useless drafter the method so stays within a few percent of `ar`: on the 2-core AVX2 CPU an
    exploring step costs ~1.5-3 plain ones; 1 in 8 cost ~5-20%, 3 per 64-token prompt ~2%.
    A step's rate is noisy (1 token or a few, whatever the tree), so the estimate wanders: drafting stops only while
    the estimate is below plain decoding's rate by more than `confidence` of its own spread (the EMA's standard
    error), so that a drafter that pays by a few percent keeps drafting, and one that loses stops as soon."""
    explore_every: int = 8
    max_interval: int = 64
    alpha: float = 0.1  # per drafted step: single steps are noisy (1 to block tokens); 0.2 measured worse
    explore_alpha: float = 0.5
    confidence: float = 2.0  # standard errors of the estimate that it must fall below plain decoding by
    rate: float | None = None  # EMA of tokens / modeled second over drafted steps
    spread: float = 0.0  # EMA of the squared deviations of the steps' rates from `rate`
    skipped: int = 0
    interval: int = 0  # plain steps between explorations now (explore_every .. max_interval)
    exploring: bool = False  # the current step explores

    def restart(self) -> None:
        """A new prompt: explore soon (what held for the last prompt may not hold here); the estimate stays."""
        self.skipped, self.interval = 0, self.explore_every

    def draft_now(self, cost: CostModel, context: int | None = None) -> bool:
        ar_rate = 1.0 / cost.plain_seconds_at(context)
        self.exploring = False
        if self.rate is None or self.rate + self.confidence * self.stderr() >= ar_rate:
            self.skipped, self.interval = 0, self.explore_every
            return True
        self.interval = self.interval or self.explore_every
        if self.skipped + 1 >= self.interval:  # explore; if it still loses, wait twice as long next time
            self.skipped, self.interval = 0, min(2 * self.interval, self.max_interval)
            self.exploring = True
            return True
        self.skipped += 1
        return False

    def stderr(self) -> float:
        """The standard error of the rate's EMA: a step rate's spread times sqrt(alpha / (2 - alpha))."""
        return (self.spread * self.alpha / (2 - self.alpha)) ** 0.5

    def update(self, tokens: int, seconds: float) -> None:
        r, a = tokens / seconds, self.explore_alpha if self.exploring else self.alpha
        if self.rate is None:
            self.rate = r
            return
        self.spread = (1 - self.alpha) * self.spread + self.alpha * (r - self.rate) ** 2
        self.rate = (1 - a) * self.rate + a * r


@dataclass
class EdgeCalibration:
    """How far to trust the drafter's probabilities, learned online: each tree edge's probability is scaled by
    c in [0.01, 1], so a node at depth d counts p * c**d. A random or over-confident drafter (which predicts
    long accepted paths that never come) drives c down and the budget with it; a calibrated one keeps c ~ 1.

    c solves  sum_d P_d c**d = A  over the steps seen, each weighed `decay` per step since (about 1 / (1 - decay)
    steps of memory): A the accepted draft tokens, P_d the summed probability of the verified nodes at depth d.
    Ratios of sums, not an average of per-step ratios: one step's accepted count is 0 or a few tokens whatever
    its prediction, and averaging the logs of such ratios drags c well below a calibrated drafter's 1. It starts
    with `prior` tokens' worth of full trust (as many depth-1 nodes of probability 1, accepted), which the
    evidence outweighs within a few steps. Python floats throughout: a step updates a few depths, where numpy's
    per-call cost would be most of the update's time."""
    c: float = 1.0
    decay: float = 0.98
    prior: float = 2.0
    accepted: float = field(init=False)  # A
    by_depth: list[float] = field(init=False)  # P_d, index d (depth 0 unused), as deep as the deepest tree seen

    def __post_init__(self):
        self.accepted, self.by_depth = self.prior, [0.0, self.prior]

    def predicted(self, path_logprobs: np.ndarray, depths: np.ndarray) -> float:
        return float(np.sum(np.exp(path_logprobs) * self.c ** np.asarray(depths, dtype=np.float64)))

    def update(self, path_logprobs: np.ndarray, depths: np.ndarray, accepted: int) -> None:
        """accepted: draft tokens the target accepted this step (bonus excluded)."""
        depths, logp = _as_list(depths), _as_list(path_logprobs)
        decay = self.decay
        by_depth = [decay * p for p in self.by_depth] + [0.0] * (max(depths) + 1 - len(self.by_depth))
        for lp, d in zip(logp, depths):
            by_depth[d] += math.exp(lp)
        self.by_depth = by_depth
        self.accepted = decay * self.accepted + accepted
        self.c = self._solve()

    def _solve(self, lo: float = 0.01, hi: float = 1.0) -> float:
        """The c in [lo, hi] with sum_d P_d c**d = A (the bound where none is inside): predicted mass rises with c.
        Newton's method from the last c, kept inside the bracket by bisection, to 1e-7 (a few passes over the
        depths: c moves little from one step to the next)."""
        coefficients, target = self.by_depth[::-1], self.accepted

        def excess(c: float) -> tuple[float, float]:
            total = slope = 0.0
            for p in coefficients:  # Horner: sum_d P_d c**d and its derivative
                slope = slope * c + total
                total = total * c + p
            return total - target, slope

        if excess(hi)[0] <= 0:
            return hi
        if excess(lo)[0] >= 0:
            return lo
        c = min(max(self.c, lo), hi)
        for _ in range(60):
            f, slope = excess(c)
            if f == 0.0:
                return c
            lo, hi = (c, hi) if f < 0 else (lo, c)
            step = c - f / slope if slope > 0 else None
            if step is None or not lo < step < hi:
                step = 0.5 * (lo + hi)  # no Newton step inside the bracket: bisect
            if abs(step - c) < 1e-7:
                return step
            c = step
        return c


@torch.inference_mode()
def calibrate(target, drafter, context: int = 256, sizes=CALIBRATION_SIZES, repeats: int = 5,
              block_size: int | None = None, stop_when_hopeless: bool = True,
              long_context: int = LONG_CONTEXT) -> CostModel:
    """Time the target's verify pass for each tree size (a chain: on these sizes the mask shape barely matters)
    after `context` committed tokens, and the drafter's pass at each length as decoding meets it: right after a
    target pass (whose weights have evicted the drafter's from the caches) and with a step's accepted tokens'
    context to compute first. Per pass the median of `repeats` rounds over all of them, after a warm-up round.
    The step's host work (tree build, visibility, walk, commit) is timed on a draft's own log-probs.
    With stop_when_hopeless, sizes stop after the first whose step costs more than `block` plain steps: such a
    step loses to plain decoding even when the whole block is accepted, so no larger tree is worth timing (on
    a 2-core AVX2 CPU this skips the 128..512-node passes, seconds each).
    Then the sizes up to KEY_SIZES_MAX are timed again after `long_context` committed tokens (where the target's
    context allows): the difference per token is the curve's key_seconds (CostModel)."""
    cfg, device = target.cfg, target.device
    limit = cfg.max_position_embeddings
    sizes = tuple(n for n in sizes if n < limit) or (1,)
    context = max(1, min(context, limit - max(sizes)))
    long_context = min(long_context, limit - max(sizes))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (max(context, long_context) + max(sizes),), generator=gen).to(device)
    taps = tuple(drafter.cfg.target_layer_ids)
    cache = target.new_cache(max(context, long_context) + max(sizes))
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
    accepted = 2  # a step's accepted tokens: the next draft computes their context first
    rounds = repeats + 2
    dcache = drafter.new_cache(context + max(block, max(sizes)) + accepted * (block - 1) * rounds)
    drafter.add_context(dcache, out.taps)
    bonus, step_features = ids[context:context + 1], out.taps[-accepted:]
    plain = (ids[context:context + 1], torch.arange(context, context + 1, device=device),
             Visibility.causal(context, 1, device))

    def draft_after_verify(n: int) -> float:
        # a plain step's pass, not committed: what matters is the caches it leaves, not its K/V
        target(*plain[:2], cache, plain[2], taps, last_only=True)
        drafter.add_context(dcache, step_features)
        return once(lambda: drafter.draft(dcache, bonus, n))

    passes = [lambda n=n: draft_after_verify(n) for n in range(2, block + 1)]
    for fn in passes:  # warm-up
        fn()
    host_step = _host_step(target, drafter, drafter.draft(dcache, bonus, block), bonus, max(1, min(8, max(sizes) - 1)))
    host_step()  # warm-up
    # + a tenth standing in for the walk and commit
    host = float(np.median([once(host_step) for _ in range(repeats)])) * 1.1
    fixed = passes[-1]() + host
    for n in sizes:  # a first (warm-up) round, which also finds the sizes worth timing
        passes.append(_timed_chain(target, ids, cache, taps, context, n, once))
        passes[-1]()  # a first call may set up (a GPU runtime captures its graphs, Triton compiles): untimed
        seconds = passes[-1]()
        if n == sizes[0]:
            first = seconds
        if stop_when_hopeless and sizes[0] == 1 and fixed + seconds > block * first:
            break
    # then `repeats` rounds over every pass in turn, so that a machine whose speed drifts (other processes, clock)
    # shifts all sizes alike instead of bending the curve: auto's choices rest on the ratios between sizes
    times = [[fn() for fn in passes] for _ in range(repeats)]
    medians = np.median(np.asarray(times), axis=0)
    drafts = tuple(float(t) for t in np.maximum.accumulate(medians[:block - 1]))  # longer drafts never cost less
    verify = medians[block - 1:]
    fixed = drafts[-1] + host
    verify = tuple(float(t) for t in np.maximum.accumulate(verify))  # more nodes never cost less: noise does
    keys = _key_seconds(target, ids, cache, taps, context, long_context,
                        [n for n in sizes[:len(verify)] if n <= KEY_SIZES_MAX], verify, repeats, once)
    return CostModel(sizes[:len(verify)], tuple(verify), fixed, drafts, context, keys)


def _timed_chain(target, ids, cache, taps, past: int, n: int, once):
    """A function timing (with `once`) the target's verify of an n-node chain of ids[past:past + n] after `past`
    committed tokens of `cache` (not committed: every call writes the same rows)."""
    device = ids.device
    parents, depths = chain_parents(n)
    anc = torch.from_numpy(ancestor_matrix(parents, depths)).to(device) if n > 1 else None
    vis, pos = Visibility(past, anc), torch.arange(past, past + n, device=device)
    return lambda: once(lambda: target(ids[past:past + n], pos, cache, vis, taps))


def _key_seconds(target, ids, cache, taps, context: int, long_context: int, sizes, verify, repeats: int,
                 once) -> tuple[float, ...]:
    """Per size, the seconds each committed token beyond `context` adds to a verify: the sizes timed again after
    `long_context` tokens (the cache filled up to there), as calibrate times them. () where the target's context
    leaves no room for it."""
    if long_context <= context or not sizes:
        return ()
    device = ids.device
    n = long_context - context
    target(ids[context:long_context], torch.arange(context, long_context, device=device), cache,
           Visibility.causal(context, n, device), taps, last_only=True)
    cache.commit(n)
    passes = [_timed_chain(target, ids, cache, taps, long_context, size, once) for size in sizes]
    for fn in passes:  # warm-up
        fn()
    medians = np.median(np.asarray([[fn() for fn in passes] for _ in range(repeats)]), axis=0)
    medians = np.maximum.accumulate(medians)
    # never below 0 (noise), never falling with the tree's size
    per_key = np.maximum.accumulate(np.maximum(0.0, (medians - np.asarray(verify[:len(sizes)])) / n))
    return tuple(float(x) for x in per_key)


def _host_step(target, drafter, logits: torch.Tensor, bonus: torch.Tensor, budget: int):
    """A step's host work beside its passes, on a draft's logits, as a function to time: the tree build (log-softmax,
    best-first nodes, tokens) and the verify's visibility, with the target's step operations."""
    ops = step_ops_for(target)
    bonus = ops.root(int(bonus[0]), target.device)

    def step() -> None:
        parents, depths, ids, _ = ops.tree_nodes(drafter, logits.float().log_softmax(dim=-1), bonus, budget)
        ops.tree_tokens(drafter, bonus, ids)
        ops.visibility(parents, depths, 0, target.device)

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
