"""Adaptive DDTree budget: the cost model, the choice rule, the pop-order prefix property, losslessness."""
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import plant_oracle, run
from ddtree.engine.budget import CostModel, DraftGate, EdgeCalibration, RowCostFeedback, calibrate, choose_budget
from ddtree.engine.decoder import AUTO_MAX_BUDGET, Decoder, make_method
from ddtree.engine.tree import best_first_nodes


def test_cost_model_interpolates_and_extrapolates():
    cost = CostModel((1, 5, 9), (1.0, 2.0, 4.0), fixed_seconds=0.5)
    assert cost.step_seconds(np.array([1, 3, 5, 7, 9])).tolist() == [1.5, 2.0, 2.5, 3.5, 4.5]
    assert cost.step_seconds(np.array([13]))[0] == pytest.approx(0.5 + 6.0)  # last slope (0.5 / node) continues
    with pytest.raises(ValueError, match="increasing"):
        CostModel((4, 2), (1.0, 2.0), 0.0)
    with pytest.raises(ValueError, match="one verify time"):
        CostModel((1, 2), (1.0,), 0.0)


def test_cost_model_scales_the_fixed_cost_by_the_draft_length():
    cost = CostModel((1, 9), (1.0, 3.0), fixed_seconds=0.44, draft_seconds=(0.1, 0.2, 0.3, 0.4))  # lengths 2..5
    assert cost.fixed() == cost.fixed(5) == 0.44
    assert cost.fixed(3) == pytest.approx(0.44 * 0.2 / 0.4) and cost.fixed(2) == pytest.approx(0.11)
    assert cost.fixed(9) == 0.44 and cost.fixed(1) == pytest.approx(0.11)  # clamped to the measured lengths
    assert cost.step_seconds(np.array([1, 9]), 3).tolist() == pytest.approx([1.22, 3.22])
    assert CostModel((1, 9), (1.0, 3.0), 0.44).fixed(3) == 0.44  # draft passes not measured: the block's


def test_adaptive_draft_length_follows_the_depth_of_kept_trees(pairs):
    """budget="auto" drafts one position past the deepest tree it kept in its last DEPTH_MEMORY drafted steps,
    within 2..block, and charges each step the fixed cost of the length it drafted."""
    target, drafter = pairs["llama"]
    method = make_method("ddtree", "auto", None, drafter)
    method.cost = CostModel((1, 16), (1.0, 1.1), 0.5, draft_seconds=tuple(0.1 * n for n in range(2, 9)))
    assert method.block_size == method.max_length == method.longest_draft() == 8
    lengths = []
    for depth in (1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 7, 7):
        method._last = (np.log(np.full(depth, 0.9)), np.arange(1, depth + 1))  # as keep() leaves a chain of `depth`
        method.observe([0], [])  # nothing accepted
        lengths.append(method.block_size)
    assert lengths == [3, 3, 3, 3, 3, 5, 5, 5, 5, 3, 8, 8]
    assert method.longest_draft() == 8  # what the stats report: the longest a draft may be


def test_choose_budget_by_hand():
    # fixed 1 s, verify 0.1 s per node (root included): b=1 -> 1.9/1.2, b=2 -> 2.4/1.3 (best), b=3 -> 2.5/1.4
    cost = CostModel((1, 100), (0.1, 10.0), fixed_seconds=1.0)
    assert choose_budget(np.log([0.9, 0.5, 0.1]), cost) == 2


def test_choose_budget_extremes():
    scores = np.log(np.linspace(0.9, 0.01, 50))
    free = CostModel((1, 1000), (1.0, 1.0), fixed_seconds=0.0)
    assert choose_budget(scores, free) == 50  # verifying more costs nothing: take every node
    steep = CostModel((1, 2), (1.0, 100.0), fixed_seconds=0.0)
    assert choose_budget(scores, steep) == 1
    with pytest.raises(ValueError):
        choose_budget(np.array([]), free)


@pytest.mark.parametrize("seed", range(5))
def test_pop_order_prefix_is_the_best_smaller_tree(seed):
    g = torch.Generator().manual_seed(seed)
    logprobs = (torch.randn(7, 50, generator=g) * 3).log_softmax(-1)
    parents, depths, tokens, scores = best_first_nodes(logprobs, 80)
    assert np.all(np.diff(scores) <= 1e-9), "pops come in non-increasing score order"
    for b in (1, 2, 5, 17, 40, 80):
        p, d, t, _ = best_first_nodes(logprobs, b)
        assert p.tolist() == parents[:b + 1].tolist() and d.tolist() == depths[:b + 1].tolist()
        assert t == tokens[:b]
        assert np.all(parents[1:b + 1] < np.arange(1, b + 1)), "every parent precedes its child"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_adaptive_budget_is_lossless_and_adapts(pairs, arch):
    target, drafter = pairs[arch]
    cost = CostModel((1, 8, 64, 257), (1.0, 1.2, 3.0, 12.0), fixed_seconds=0.5)  # a CPU-like curve
    sizes = []
    for i in range(6):
        prompt = [(7 * i + j) % 96 for j in range(3 + 5 * i)]
        reference, _ = run(target, None, prompt, "ar", max_new_tokens=40)
        plant_oracle(drafter, prompt + reference + [0] * 300, seed=i, top1=0.5 + 0.08 * i)
        method = make_method("ddtree", "auto", None, drafter)
        method.cost = cost
        tokens, stats = Decoder(target, drafter).generate(prompt, method, max_new_tokens=40)
        assert tokens == reference, f"adaptive ddtree diverged on prompt {i}"
        assert stats.budget == "auto" and len(stats.tree_sizes) == stats.steps
        sizes += stats.tree_sizes[:-1]  # the last step may be cut by the remaining room
    assert max(sizes) <= AUTO_MAX_BUDGET + 1
    assert len(set(sizes)) > 3, f"the budget should vary with the draft's confidence, got {sorted(set(sizes))}"


def test_calibration_on_a_tiny_model(pairs):
    target, drafter = pairs["llama"]
    cost = calibrate(target, drafter, context=32, sizes=(1, 4, 16), repeats=1, stop_when_hopeless=False)
    assert cost.sizes == (1, 4, 16) and all(t > 0 for t in cost.verify_seconds) and cost.fixed_seconds > 0
    assert cost.context == 32 and len(cost.key_seconds) == 3 and all(t >= 0 for t in cost.key_seconds)
    assert calibrate(target, drafter, context=32, sizes=(1,), repeats=1).sizes == (1,)  # block > largest size


class SleepyTarget:
    """A stand-in target and drafter for calibrate(): a verify pass over n nodes sleeps 10 ms x n^2, the
    drafter's block pass 1 ms (a steep curve, so timer jitter cannot move the stopping size)."""
    block_size = 2
    device = torch.device("cpu")
    step_ops = markov = None  # the engine's own step operations; no Markov head
    host_inputs = False

    def __init__(self):
        self.cfg = SimpleNamespace(max_position_embeddings=4096, vocab_size=50, target_layer_ids=(0,))
        self.sizes: list[int] = []

    def new_cache(self, capacity):
        return SimpleNamespace(commit=lambda n: None)

    def __call__(self, ids, positions, cache, vis, taps, last_only=False):
        if not last_only:  # a verify pass (the context prefill and a plain step before a draft are last_only)
            self.sizes.append(len(ids))
            time.sleep(0.01 * len(ids) ** 2)
        return SimpleNamespace(taps=torch.zeros(len(ids), 4))

    def add_context(self, cache, taps):
        pass

    def draft(self, cache, bonus, length):
        time.sleep(0.001)
        return torch.zeros(length - 1, self.cfg.vocab_size)

    def to_target_ids(self, ids):
        return ids


def test_calibration_stops_at_hopeless_sizes():
    """Once a step over n nodes costs more than a whole block of plain steps, larger trees are not timed."""
    fake = SleepyTarget()
    cost = calibrate(fake, fake, context=8, repeats=1, long_context=0)  # block 2: 1 ms + 40 ms > 2 x 10 ms, so stop at n = 2
    assert cost.sizes == (1, 2) and set(fake.sizes) == {1, 2}, cost


class DriftingTarget(SleepyTarget):
    """Verify passes that sleep 5 ms x n, on a machine that gets 3x slower halfway through its passes; and a
    2-node pass that (timer noise) comes back faster than a 1-node one."""
    def __call__(self, ids, positions, cache, vis, taps, last_only=False):
        if not last_only:
            self.sizes.append(len(ids))
            slow = 3.0 if len(self.sizes) > 3 + 2 * 3 else 1.0  # after the warm-up round and 2 of the 4 rounds
            time.sleep(0.005 * (0.5 if len(ids) == 2 else len(ids)) * slow)
        return SimpleNamespace(taps=torch.zeros(len(ids), 4))


def test_calibration_rounds_interleave_sizes_and_the_curve_never_falls():
    """Each round times every size once, so a slowdown halfway hits all sizes alike (sequential timing would give
    the later sizes 3x the cost), and a larger tree never costs less than a smaller one."""
    fake = DriftingTarget()
    cost = calibrate(fake, fake, context=8, sizes=(1, 2, 4), repeats=4, stop_when_hopeless=False, long_context=0)
    assert fake.sizes == [1, 1, 2, 2, 4, 4] + [1, 2, 4] * 4  # a warm-up round (a set-up call, then a timed one
    # per size), then 4 rounds over all sizes
    v = np.asarray(cost.verify_seconds)
    assert np.all(np.diff(v) >= 0), v  # the 2-node pass's 2.5 ms is lifted to the 1-node pass's cost
    assert 3.0 < v[2] / v[0] < 6.0, v  # ~4x, as on a steady machine: not bent by the drift


def test_edge_calibration_learns_distrust_and_keeps_trust():
    logp, depths = np.log([0.95, 0.9, 0.85, 0.8]), np.array([1, 2, 3, 4])
    wrong, right = EdgeCalibration(), EdgeCalibration()
    for _ in range(40):
        wrong.update(logp, depths, accepted=0)  # predicted ~3.5 accepted, got none
        right.update(logp, depths, accepted=right_accepted(right, logp, depths))
    assert wrong.c < 0.2 and right.c > 0.9


def right_accepted(cal, logp, depths):
    return int(round(cal.predicted(logp, depths)))


@pytest.mark.parametrize("truth", [1.0, 0.6])
def test_edge_calibration_finds_a_drafters_true_scale(truth):
    """A chain drafter that claims edge probability 0.8 at every depth, whose edges are right with 0.8 * truth:
    c lands near `truth` (a calibrated drafter keeps full trust), where averaging per-step log-ratios drifted to
    ~0.7 for a calibrated one (an accepted count is 0 or a few tokens, whatever the prediction)."""
    rng = np.random.default_rng(0)
    logp, depths = np.log(0.8 ** np.arange(1, 6)), np.arange(1, 6)
    cal, seen = EdgeCalibration(), []
    for step in range(600):
        accepted = 0
        while accepted < 5 and rng.random() < 0.8 * truth:
            accepted += 1
        cal.update(logp, depths, accepted)
        if step >= 200:
            seen.append(cal.c)
    assert abs(np.median(seen) - truth) < 0.08, np.median(seen)


def test_adaptive_budget_shrinks_for_a_confidently_wrong_drafter(pairs):
    """A drafter that is sure of wrong tokens: the first trees are deep, the calibrated ones tiny; still exact."""
    import types

    target, drafter = pairs["qwen3"]
    vocab = drafter.cfg.model.vocab_size

    def draft(self, cache, bonus, length=None):
        self.flush_context(cache)
        length = length or self.block_size
        logits = torch.zeros(length - 1, vocab)
        logits[torch.arange(length - 1), (torch.arange(length - 1) * 7 + cache.length) % vocab] = 30.0
        return logits

    drafter.draft = types.MethodType(draft, drafter)
    prompt = [3, 1, 4, 1, 5]
    reference, _ = run(target, None, prompt, "ar", max_new_tokens=40)
    cost = CostModel((1, 8, 64, 257), (1.0, 1.2, 3.0, 12.0), fixed_seconds=0.5)
    runs = {}
    try:
        for gated in (False, True):
            method = make_method("ddtree", "auto", None, drafter)
            method.cost = cost
            if not gated:  # every step drafts: what the trust calibration alone does
                method.gate = DraftGate(explore_every=1)
            tokens, stats = Decoder(target, drafter).generate(prompt, method, max_new_tokens=40)
            assert tokens == reference
            runs[gated] = stats.tree_sizes, method.calibration.c  # the method's own state: the decoder has none
    finally:
        del drafter.draft
    sizes, c = runs[False]
    assert sizes[0] >= 8 and max(sizes[-5:]) <= 3 and c < 0.3, (sizes, c)
    # drafting never pays here: with the gate, most steps skip the drafter (tree = root alone)
    sizes, _ = runs[True]
    assert sizes[0] >= 8 and sizes.count(1) >= 0.75 * len(sizes), sizes


def test_draft_gate():
    cost = CostModel((1, 16), (1.0, 2.0), fixed_seconds=0.5)  # ar: 1 token/s
    gate = DraftGate(explore_every=4, max_interval=16)
    assert gate.draft_now(cost)  # no estimate yet: draft
    for _ in range(10):
        gate.update(tokens=1, seconds=2.5)  # drafted steps yield 0.4 tokens/s
    decisions = [gate.draft_now(cost) for _ in range(4 + 8 + 16 + 16)]
    explored = [i for i, d in enumerate(decisions) if d]
    assert explored == [3, 11, 27, 43]  # explore after 4, then 8, then 16 (the cap) steps while drafting loses
    for _ in range(20):
        gate.update(tokens=5, seconds=2.5)  # now drafting yields 2 tokens/s
    assert all(gate.draft_now(cost) for _ in range(5))
    assert gate.interval == 4  # a win resets the back-off


def test_draft_gate_explores_early_in_each_prompt_and_an_exploring_win_counts():
    cost = CostModel((1, 16), (1.0, 2.0), fixed_seconds=0.5)  # ar: 1 token/s
    gate = DraftGate(explore_every=4, max_interval=64, explore_alpha=0.5)
    gate.update(tokens=1, seconds=2.5)  # drafting lost (0.4 tokens/s) ...
    for _ in range(100):
        gate.draft_now(cost)
    assert gate.interval == 64  # ... and backed off
    gate.restart()  # a new prompt
    assert [gate.draft_now(cost) for _ in range(4)] == [False, False, False, True] and gate.exploring
    gate.update(tokens=5, seconds=2.5)  # the exploring step pays (2 tokens/s): half the estimate moves
    assert gate.rate == pytest.approx(1.2) and gate.draft_now(cost) and not gate.exploring


class CachedDrafter(SleepyTarget):
    """A drafter whose pass costs 8 ms right after a target pass (its weights evicted) and 1 ms when it ran last:
    calibrate() must time what decoding meets, a draft after a verify."""
    def __init__(self):
        super().__init__()
        self.cold = True

    def __call__(self, ids, positions, cache, vis, taps, last_only=False):
        self.cold = True
        return super().__call__(ids, positions, cache, vis, taps, last_only)

    def draft(self, cache, bonus, length):
        time.sleep(0.008 if self.cold else 0.001)
        self.cold = False
        return torch.zeros(length - 1, self.cfg.vocab_size)


def test_drafts_are_timed_after_a_target_pass_and_the_host_work_is_in_the_fixed_cost():
    fake = CachedDrafter()
    fake.block_size = 4
    cost = calibrate(fake, fake, context=8, sizes=(1, 2), repeats=3, stop_when_hopeless=False, long_context=0)
    assert all(t > 0.007 for t in cost.draft_seconds), cost.draft_seconds  # cold, as in decoding: not 1 ms
    assert list(cost.draft_seconds) == sorted(cost.draft_seconds)  # a longer draft never costs less
    assert cost.fixed_seconds > cost.draft_seconds[-1]  # + the tree build and visibility, timed


class ContextTarget(SleepyTarget):
    """Verify passes that sleep 2 ms x n x (1 + context / 500): each committed token adds 4 us x n."""
    def __call__(self, ids, positions, cache, vis, taps, last_only=False):
        if not last_only:
            self.sizes.append(len(ids))
            time.sleep(0.002 * len(ids) * (1 + int(positions[0]) / 500))
        return SimpleNamespace(taps=torch.zeros(len(ids), 4))


def test_calibration_measures_what_each_token_of_context_adds():
    """The sizes are timed again after long_context tokens: key_seconds is the difference per token, per size."""
    fake = ContextTarget()
    cost = calibrate(fake, fake, context=8, sizes=(1, 2, 4), repeats=3, stop_when_hopeless=False, long_context=1008)
    assert cost.context == 8 and len(cost.key_seconds) == 3
    for n, per_key in zip(cost.sizes, cost.key_seconds):
        assert per_key == pytest.approx(4e-6 * n, rel=0.5), (n, cost.key_seconds)
    assert calibrate(fake, fake, context=8, sizes=(1,), repeats=1, long_context=0).key_seconds == ()


def test_a_longer_context_makes_verifies_dearer_and_trees_smaller():
    """Beyond the calibration's context each token adds key_seconds(n) to a verify of n nodes; at the calibration's
    context (or without key_seconds) the curve is as measured, and a long context picks a smaller tree."""
    sizes, verify = (1, 2, 4, 8), (0.010, 0.011, 0.013, 0.017)
    flat = CostModel(sizes, verify, 0.002, context=256)
    steep = CostModel(sizes, verify, 0.002, context=256, key_seconds=(1e-6, 2e-6, 4e-6, 8e-6))
    nodes = np.array([1, 3, 8, 12])
    assert np.allclose(steep.step_seconds(nodes, context=100), flat.step_seconds(nodes))
    assert np.allclose(steep.step_seconds(nodes), flat.step_seconds(nodes))
    assert np.allclose(steep.step_seconds(nodes, context=1256) - flat.step_seconds(nodes),
                       1000 * np.array([1e-6, 3e-6, 8e-6, 12e-6]))  # interpolated, and extrapolated past 8
    assert steep.plain_seconds_at(2256) == pytest.approx(0.010 + 2000e-6) and steep.plain_seconds == 0.010
    logp = np.log([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    short = choose_budget(logp, steep, context=256)
    long = choose_budget(logp, steep, context=4256)
    assert short == choose_budget(logp, flat) and long < short, (short, long)
    with pytest.raises(ValueError, match="key_seconds"):
        CostModel(sizes[:2], verify[:2], 0.002, key_seconds=(1e-6, 2e-6, 3e-6))


def test_choose_budget_is_the_argmax_of_the_rate_curve():
    """The per-node loop picks what the whole curve's argmax picks, inside the measured sizes and past them."""
    rng = np.random.default_rng(3)
    cost = CostModel((1, 2, 4, 8, 16), (1.0, 1.1, 1.3, 1.9, 3.2), 0.4, (0.3, 0.35, 0.4))
    for _ in range(300):
        n = int(rng.integers(1, 40))
        logp = np.sort(np.log(rng.random(n) ** 3))[::-1].copy()
        depths, c, length = rng.integers(1, 8, n), float(rng.uniform(0.3, 1.0)), int(rng.integers(2, 5))
        p = np.exp(logp) * c ** depths
        rate = (1.0 + np.cumsum(p)) / cost.step_seconds(np.arange(2, n + 2), length)
        assert choose_budget(logp, cost, depths, c, length) == int(np.argmax(rate)) + 1


def test_choose_budget_weighs_the_drafters_nodes_on_top_of_a_grafted_chain():
    """With a chain that a grafted tree carries, a drafter's node costs the rows it adds beyond the chain's: on a
    curve that steepens after 4 rows, the drafter keeps fewer nodes beside a 3-node chain than alone; where its
    nodes are the chain's own (they share them), keeping them costs nothing extra. The argmax of the whole curve."""
    cost = CostModel((1, 2, 3, 4, 5, 6, 8), (1.0, 1.05, 1.1, 1.15, 1.6, 2.0, 2.8), 0.2)
    logp = np.log([0.7, 0.5, 0.4])
    assert choose_budget(logp, cost) == 3
    assert choose_budget(logp, cost, chain_added=[3, 3, 3, 3], chain_yield=0.5) == 1
    assert choose_budget(logp, cost, chain_added=[3, 2, 1, 0], chain_yield=0.3) == 3  # its nodes hold the chain
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        logp = np.sort(np.log(rng.random(n) ** 2))[::-1].copy()
        added = np.minimum.accumulate(rng.integers(0, 9, n + 1)).tolist()  # sharing only grows with the tree
        y = float(rng.uniform(0.1, 1.0))
        rate = [(1 + np.exp(logp[:b]).sum() + y * added[b]) / cost.step_seconds(np.array([b + 1 + added[b]]))[0]
                for b in range(1, n + 1)]
        assert choose_budget(logp, cost, chain_added=added, chain_yield=y) == int(np.argmax(rate)) + 1


def test_row_cost_feedback_learns_what_rows_cost_against_the_curve():
    """Steps whose rows cost twice the curve's price (plus a draft the curve misprices, plus noise) teach a scale of
    ~2; steps at the curve's price, ~1; steps that all price their rows alike say nothing about the slope (it stays
    at the prior's 1); the scale stays inside its limits."""
    rng = np.random.default_rng(0)
    for truth in (2.0, 1.0, 0.7):
        feedback = RowCostFeedback()
        for _ in range(400):
            priced = float(rng.choice([0.3e-3, 0.6e-3, 1.2e-3, 2.0e-3]))
            feedback.update(priced, 5e-3 + truth * priced + float(rng.normal(0, 0.3e-3)))
        assert abs(feedback.scale - truth) < 0.15, (truth, feedback.scale)
    flat = RowCostFeedback()
    for _ in range(100):
        flat.update(0.6e-3, 9e-3 + float(rng.normal(0, 1e-3)))
    assert flat.scale == pytest.approx(1.0, abs=0.05)
    steep = RowCostFeedback()
    for priced in [0.1e-3, 1e-3] * 50:
        steep.update(priced, 100 * priced)
    assert steep.scale == steep.limits[1]


def test_choose_budget_scales_the_rows_price():
    """row_scale multiplies the price of the rows beyond the root: dearer rows, smaller trees (the argmax of the
    scaled curve)."""
    cost = CostModel((1, 2, 4, 8, 16), (1.0, 1.1, 1.3, 1.9, 3.2), 0.4)
    logp = np.log([0.9, 0.8, 0.6, 0.5, 0.3, 0.2, 0.1])
    sizes = [choose_budget(logp, cost, row_scale=s) for s in (0.5, 1.0, 2.0, 4.0)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    for s in (0.5, 2.0, 3.0):
        base = cost.step_seconds(np.arange(1, len(logp) + 2))
        scaled = base[0] + s * (base - base[0])
        rate = (1 + np.cumsum(np.exp(logp))) / scaled[1:]
        assert choose_budget(logp, cost, row_scale=s) == int(np.argmax(rate)) + 1


def test_auto_times_each_drafted_step_against_the_curves_price_of_its_rows(pairs):
    """ddtree:auto hands every drafted step's verify time and the curve's price of its rows beyond the root to its
    RowCostFeedback (and the tokens stay plain decoding's)."""
    target, drafter = pairs["llama"]
    prompt = [5, 6, 7, 8] * 4
    reference, _ = run(target, None, prompt, "ar", max_new_tokens=24)
    method = make_method("ddtree:auto", None, None, drafter)
    method.cost = CostModel((1, 64), (1e-3, 64e-3), 1e-6)  # 1 ms a row
    method.gate.draft_now = lambda cost, context=None: True  # draft every step, however the random drafter fares
    seen = []
    method.row_costs.update = lambda priced, seconds: seen.append((priced, seconds))
    trace = []
    tokens, stats = Decoder(target, drafter).generate(prompt, method, max_new_tokens=24, trace=trace)
    assert tokens == reference
    assert len(seen) == len(trace) and all(seconds > 0 for _, seconds in seen)
    assert sum(seconds for _, seconds in seen) == pytest.approx(stats.stage_seconds["verify"])  # every step's verify
    assert [round(priced * 1e3) for priced, _ in seen] == [len(rec["parents"]) - 1 for rec in trace]


def test_tree_step_seconds_are_step_seconds_as_floats():
    """The per-step rule's lists (no numpy) hold step_seconds' values, inside the measured curve and past it."""
    cost = CostModel((1, 2, 4, 8), (0.010, 0.011, 0.013, 0.017), 0.002, (0.001, 0.0015), context=256,
                     key_seconds=(1e-6, 2e-6, 4e-6))
    for count in (0, 1, 3, 6, 7, 12):
        for length in (None, 2, 3):
            for context in (None, 100, 256, 1256):
                listed = cost.tree_step_seconds(count, length, context)
                assert all(type(x) is float for x in listed)
                assert listed == cost.step_seconds(np.arange(1, count + 2), length, context).tolist()
    assert cost.plain_seconds_at(1256) == pytest.approx(0.010 + 1000e-6)


def test_edge_calibration_solves_its_equation():
    """c is the root of sum_d P_d c**d = A inside [0.01, 1], or the bound where the root lies outside."""
    rng = np.random.default_rng(1)
    for _ in range(500):
        cal = EdgeCalibration(c=float(rng.uniform(0.01, 1.0)))  # Newton starts from the last c
        cal.by_depth = [0.0] + (rng.random(int(rng.integers(1, 9))) * rng.random() * 5).tolist()
        cal.accepted = float(rng.random() * 4)
        c = cal._solve()
        excess = np.polyval(cal.by_depth[::-1], c) - cal.accepted
        if 0.01 < c < 1.0:
            assert abs(excess) < 1e-6 * max(1.0, sum(cal.by_depth)), (c, excess)
        else:
            assert (c == 1.0 and excess <= 0) or (c == 0.01 and excess >= 0), (c, excess)
