"""Sampling losslessness: at T > 0 every method's sequences follow the target's own distribution.

On a 6-token vocabulary, the exact probability of every 3-token continuation is enumerated from the target;
each method's empirical distribution over many seeded samples is then tested with a chi-square test at
alpha = 1e-3 (deterministic: fixed seeds). A deliberately biased acceptance rule must FAIL the same test.
"""
import itertools
import math

import pytest
import torch

from ddtree.models.attention import Visibility
from ddtree.base.config import SamplingParams
from ddtree.engine.decoder import Decoder, make_method
from ddtree.engine.lookup import ContextLookup
from ddtree.engine.ngram_table import NgramTable
from ddtree.engine.sampling import processed_probs
from ddtree.bench.testing import random_pair
from ddtree.engine.tree import walk

VOCAB, LENGTH, SAMPLES = 6, 3, 2400
PROMPT = [1, 4, 2, 5]


@pytest.fixture(scope="module")
def pair():
    return random_pair("llama", seed=21, block_size=4, vocab_size=VOCAB, init_scale=0.6)


def exact_distribution(target, params: SamplingParams) -> dict[tuple, float]:
    dist = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        ids = torch.tensor(PROMPT + list(seq))
        cache = target.new_cache(len(ids))
        logits = target(ids, torch.arange(len(ids)), cache, Visibility.causal(0, len(ids), "cpu")).logits
        probs = processed_probs(logits[len(PROMPT) - 1:-1], params)
        dist[seq] = float(torch.prod(probs[torch.arange(LENGTH), torch.tensor(seq)]))
    return dist


def chi_square_rejects(counts: dict, dist: dict, n: int, alpha_z: float = 3.09) -> tuple[bool, float, float]:
    """Pearson chi-square with bins of expected count < 5 pooled; critical value by Wilson-Hilferty."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for seq, p in dist.items():
        exp, obs = p * n, counts.get(seq, 0)
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
        else:
            stat += (obs - exp) ** 2 / exp
            bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    k = bins - 1
    critical = k * (1 - 2 / (9 * k) + alpha_z * math.sqrt(2 / (9 * k))) ** 3
    return stat > critical, stat, critical


def sample_counts(decoder, method, params, n=SAMPLES):
    counts = {}
    for s in range(n):
        tokens, _ = decoder.generate(PROMPT, method, params, LENGTH, seed=s)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


class BiasedDecoder(Decoder):
    """Accepts a draft child whenever the target gives it >= 25% probability, instead of drawing: biased."""

    def accept(self, tree, ancestors, logits, sampling, generator):
        probs = processed_probs(logits[:], sampling)  # all rows (the engine may hand RowLogits)
        choices = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        for child in range(1, tree.size):
            parent, tok = int(tree.parents[child]), int(tree.tokens[child])
            if probs[parent, tok] >= 0.25:
                choices[parent] = tok
        return walk(tree, ancestors, choices)


CASES = [("ar", 1, SamplingParams(1.0)), ("dflash", 1, SamplingParams(1.0)), ("ddtree", 6, SamplingParams(1.0)),
         ("ddtree", 20, SamplingParams(0.7, top_p=0.9, top_k=4)), ("ar", 1, SamplingParams(0.7, top_p=0.9, top_k=4))]


@pytest.mark.slow
@pytest.mark.parametrize("name,budget,params", CASES, ids=[f"{c[0]}-{c[1]}-T{c[2].temperature}" for c in CASES])
def test_sampling_matches_target_distribution(pair, name, budget, params):
    target, drafter = pair
    dist = exact_distribution(target, params)
    counts = sample_counts(Decoder(target, drafter), make_method(name, budget, None, drafter), params)
    rejected, stat, critical = chi_square_rejects(counts, dist, SAMPLES)
    assert not rejected, f"chi-square {stat:.1f} > critical {critical:.1f}: {name} is not lossless"


@pytest.mark.slow
def test_biased_acceptance_rule_is_caught(pair):
    target, drafter = pair
    params = SamplingParams(1.0)
    dist = exact_distribution(target, params)
    counts = sample_counts(BiasedDecoder(target, drafter), make_method("ddtree", 6, None, drafter), params)
    rejected, stat, critical = chi_square_rejects(counts, dist, SAMPLES)
    assert rejected, f"the biased rule went unnoticed (chi-square {stat:.1f} <= {critical:.1f})"


def test_processed_probs_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = processed_probs(logits, SamplingParams(1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and p.sum().item() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    p = processed_probs(logits, SamplingParams(1.0, top_p=float(full[0]) + 1e-3))
    assert (p[0, 2:] == 0).all() and p[0, 1] > 0  # the first token alone falls short of top_p
    p = processed_probs(logits, SamplingParams(1.0, top_p=0.01))
    assert p[0, 0] == 1.0


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 20.0])  # flat rows need the head to grow, peaked ones do not
def test_nucleus_equals_the_full_sort(scale):
    """nucleus() sorts only the head of the order (topk, grown until it holds top_p): the same distribution, bit for
    bit, as sorting the whole vocabulary, whatever the nucleus' size."""
    from ddtree.engine.sampling import TOP_P_FIRST_K, nucleus

    gen = torch.Generator().manual_seed(int(scale * 100))
    probs = (torch.randn(4, 5000, generator=gen) * scale).softmax(-1)
    for top_p in (1e-6, 0.3, 0.9, 0.99, 1.0 - 1e-7):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(dim=-1) - sorted_p >= top_p, 0.0)
        want = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        want = want / want.sum(dim=-1, keepdim=True)
        got = nucleus(probs, top_p)
        assert torch.equal(got, want), (scale, top_p)
        assert ((got > 0).sum(-1) >= 1).all()
    assert (nucleus(probs, 0.99) > 0).sum(-1).max() > TOP_P_FIRST_K or scale > 1  # flat rows grew the head


def test_greedy_argmax_kernel_gives_torch_argmax():
    """The greedy choice goes through the CPU kernel's argmax_rows on float32 CPU logits: torch.argmax's index on
    every row, ties (the first maximum), infinities and NaNs (the first NaN) included."""
    from ddtree.runtime.cpu import qlinear
    from ddtree.engine.sampling import argmax

    if not qlinear.cpu_kernel_available():
        pytest.skip("no CPU kernel on this machine")
    gen = torch.Generator().manual_seed(0)
    nan, inf = float("nan"), float("inf")
    big = torch.randn(4, 49152, generator=gen)
    big[1, 40000] = nan
    big[2, 49151] = 1e9  # in the tail-free last block
    big[3, 7], big[3, 49150] = 1e9, 1e9  # a tie: the first one
    cases = [torch.tensor([[1.0, nan, 3.0, nan], [-inf] * 4, [2.0, 5.0, 5.0, 1.0], [inf, 1.0, inf, 0.0]]), big,
             torch.randn(3, 13, generator=gen), torch.zeros(2, 100), torch.tensor([[-0.0, 0.0, -0.0]]),
             torch.randint(0, 3, (6, 1037), generator=gen).float(), torch.randn(5, 8, generator=gen)[:, ::2]]
    for logits in cases:
        assert torch.equal(argmax(logits), logits.argmax(dim=-1)), logits
    with pytest.raises(RuntimeError, match="argmax_rows: x must be float32"):
        qlinear.kernel().argmax_rows(torch.zeros(2, 0))


@pytest.mark.slow
def test_sampling_kernel_is_the_inverse_cdf_and_never_draws_a_zero():
    """sample_rows (the CPU draw behind choose at T > 0): the first index whose running double sum exceeds u x the
    row's total, never one of probability zero, at either end of u's range; a row with no mass is an error."""
    from ddtree.runtime.cpu import qlinear
    from ddtree.engine.sampling import sample

    if not qlinear.cpu_kernel_available():
        pytest.skip("no CPU kernel on this machine")
    kernel = qlinear.kernel()
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(5, 1037, generator=gen) ** 4
    probs[probs < 0.2] = 0.0  # most entries zero, as after top-k / top-p
    probs[:, :3] = 0.0
    probs[:, -5:] = 0.0
    u = torch.tensor([0.0, 0.25, 0.5, 0.999, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    got = kernel.sample_rows(probs, u)
    for i in range(5):
        p = probs[i].double()
        nonzero = torch.nonzero(p > 0).squeeze(-1)
        cum = torch.cumsum(p, 0)
        expected = int(nonzero[torch.nonzero(cum[nonzero] > u[i] * cum[-1])[0]]) if u[i] < 0.99 else None
        assert probs[i, got[i]] > 0, i
        if expected is not None:
            assert int(got[i]) == expected, (i, int(got[i]), expected)
    assert int(got[0]) == int(torch.nonzero(probs[0] > 0)[0])  # u = 0: the first possible token
    assert int(got[4]) == int(torch.nonzero(probs[4] > 0)[-1])  # u -> 1: the last one
    with pytest.raises(RuntimeError, match="no probability mass"):
        kernel.sample_rows(torch.zeros(1, 64), torch.zeros(1, dtype=torch.float64))
    # and the draws follow the distribution over a full-size vocabulary: 4 likely tokens among 49,152
    row = torch.full((1, 49152), 1e-7)
    row[0, [5, 100, 30000, 49151]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = torch.cat([sample(row, gen) for _ in range(4000)])
    for token, p in zip([5, 100, 30000, 49151], [0.4, 0.3, 0.2, 0.1]):
        share = float((draws == token).float().mean())
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / 4000), (token, share, p)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30])
def test_a_tiny_temperature_samples_the_top_token(temperature):
    """logits / 1e-40 overflow float32: the distribution is still the limit one (all mass on the top token), never
    a row with "no probability mass"; decoding at such a temperature gives the greedy tokens, for every method."""
    from ddtree.api import Pair
    from ddtree.bench.testing import random_pair

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 5
    probs = processed_probs(logits, SamplingParams(temperature=temperature))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
    pair = Pair(*random_pair("llama", seed=3), None)
    greedy = pair.generate([1, 2, 3], method="ar", max_new_tokens=8).token_ids
    for method in ("ar", "ddtree"):
        assert pair.generate([1, 2, 3], method=method, max_new_tokens=8, temperature=temperature,
                             seed=1).token_ids == greedy


def sample_with_grafts(target, drafter, method, params) -> tuple[dict, int, int]:
    """SAMPLES generations of PROMPT: the count of each output, the nodes grafted in all, and the steps that
    accepted a grafted node."""
    decoder, counts, grafted, accepted_grafts = Decoder(target, drafter), {}, 0, 0
    for s in range(SAMPLES):
        records = []
        tokens, _ = decoder.generate(PROMPT, method, params, LENGTH, seed=s, trace=records)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
        for rec in records:
            grafted += rec["grafted"]
            accepted_grafts += any(node >= len(rec["parents"]) - rec["grafted"] for node in rec["accepted"])
    return counts, grafted, accepted_grafts


@pytest.mark.slow
def test_sampling_with_grafted_lookup_chains_matches_target_distribution(pair):
    """ddtree:N+lookup at T = 1: chains copied from the context change the tree, never the distribution. A 1-token
    match on a 6-token vocabulary grafts a chain nearly every step, and some of them are accepted."""
    target, drafter = pair
    params = SamplingParams(1.0)
    method = make_method("ddtree:2+lookup", None, None, drafter)
    method.lookup = ContextLookup(match=1, length=3)
    counts, grafted, accepted_grafts = sample_with_grafts(target, drafter, method, params)
    assert grafted > SAMPLES and accepted_grafts > SAMPLES // 10, (grafted, accepted_grafts)
    rejected, stat, critical = chi_square_rejects(counts, exact_distribution(target, params), SAMPLES)
    assert not rejected, f"chi-square {stat:.1f} > critical {critical:.1f}: ddtree+lookup is not lossless"


@pytest.mark.slow
def test_sampling_with_grafted_table_chains_matches_target_distribution(pair):
    """ddtree:N+lookup at T = 1 with an n-gram table (ngram_table.py) whose every 3-gram of the 6-token vocabulary has
    a continuation: where the context has no match, the table's chains change the tree, never the distribution."""
    target, drafter = pair
    params = SamplingParams(1.0)
    grams = list(itertools.product(range(target.cfg.vocab_size), repeat=3))
    table = NgramTable(grams, [(a + b + c) % target.cfg.vocab_size for a, b, c in grams], target.cfg.vocab_size)
    method = make_method("ddtree:2+lookup", None, None, drafter, table)
    method.lookup = ContextLookup(match=30, length=3, longer=(), table=table)  # the context never matches
    counts, grafted, accepted_grafts = sample_with_grafts(target, drafter, method, params)
    assert grafted > SAMPLES and accepted_grafts > SAMPLES // 20, (grafted, accepted_grafts)
    rejected, stat, critical = chi_square_rejects(counts, exact_distribution(target, params), SAMPLES)
    assert not rejected, f"chi-square {stat:.1f} > critical {critical:.1f}: ddtree+lookup with a table is not lossless"


def test_at_temperature_one_the_probabilities_are_the_divided_logits():
    """processed_probs skips the division at T = 1 (it changes no bit there): the probabilities of dividing first,
    bit for bit, with top-k and top-p too."""
    from ddtree.engine.sampling import nucleus

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 4
    for top_k, top_p in ((0, 1.0), (50, 1.0), (0, 0.8)):
        scaled = logits / 1.0
        if top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
        expected = scaled.softmax(dim=-1)
        expected = nucleus(expected, top_p) if top_p < 1.0 else expected
        assert torch.equal(processed_probs(logits, SamplingParams(1.0, top_p, top_k)), expected), (top_k, top_p)
