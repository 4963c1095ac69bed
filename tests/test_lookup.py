"""The context lookup (ddtree/engine/lookup.py) and grafting its chain onto a tree (tree.graft_chain)."""
import math
import random

import numpy as np
import pytest
import torch

from conftest import run
from ddtree.bench.testing import random_pair
from ddtree.engine.budget import CostModel
from ddtree.engine.decoder import Decoder, make_method
from ddtree.engine.lookup import ContextLookup
from ddtree.engine.tree import ancestor_matrix, best_first_nodes, chain_added, graft_chain


def brute_force_chain(tokens, match, length, longer=()):
    """The continuation of the latest earlier occurrence of the last `match` tokens, by scanning: `length` tokens, or
    a longer tier's where that occurrence agrees with the end of `tokens` on at least as many tokens as it needs."""
    key = tokens[-match:]
    for end in range(len(tokens) - 2, match - 2, -1):
        if tokens[end - match + 1:end + 1] == key:
            agree = next((k for k in range(len(tokens)) if k > end or tokens[end - k] != tokens[-1 - k]), None)
            n = max([length] + [n for needs, n in longer if agree >= needs])
            return tokens[end + 1:end + 1 + n]
    return []


@pytest.mark.parametrize("match,length,longer", [(1, 3, ()), (2, 4, ()), (3, 4, ()), (4, 8, ()), (1, 2, ((3, 5),)),
                                                 (2, 3, ((4, 6), (7, 9)))])
def test_chain_is_the_latest_earlier_occurrences_continuation(match, length, longer):
    rng = random.Random(match * 10 + length)
    for _ in range(30):
        tokens = [rng.randrange(3 if longer else 4) for _ in range(rng.randint(1, 60))]
        lookup = ContextLookup(match, length, longer)
        lookup.start(tokens[:5])
        for i in range(5, len(tokens), 3):  # committed a few at a time, as steps commit them
            lookup.extend(tokens[i:i + 3])
            assert lookup.chain() == brute_force_chain(tokens[:i + 3], match, length, longer)
    assert ContextLookup(3, 4).chain() == []
    with pytest.raises(ValueError, match="match >= 1"):
        ContextLookup(0, 4)
    with pytest.raises(ValueError, match="longer tiers"):
        ContextLookup(3, 4, ((6, 3),))


def test_a_longer_agreement_copies_further():
    lookup = ContextLookup()  # the shipped tiers: 3 -> 4, 6 -> 8, 10 -> 12 tokens
    text = list(range(100, 120))
    lookup.start(text + [7, 8] + text[:3])  # 3 tokens agree: 4 copied
    assert lookup.chain() == text[3:7] and lookup.tier == 0
    lookup.extend(text[3:6])  # 6 agree: 8 copied
    assert lookup.chain() == text[6:14] and lookup.tier == 1
    lookup.extend(text[6:10])  # 10 agree: 12 copied
    assert lookup.chain() == text[10:20] + [7, 8] and lookup.tier == 2
    lookup.extend(text[10:16])  # 16 agree: still 12
    assert lookup.chain() == text[16:20] + [7, 8] + text[:6] and lookup.tier == 2
    assert lookup.length == 12


def test_a_new_generation_forgets_the_last():
    lookup = ContextLookup(2, 4)
    lookup.start([5, 6, 7, 5, 6])
    assert lookup.chain() == [7, 5, 6]
    lookup.start([1, 2, 5, 6])
    assert lookup.chain() == []


def test_graft_shares_the_tree_and_appends_the_rest():
    # root 9 -> 1 (node 1) -> 2 (node 3); root -> 4 (node 2)
    tokens, parents, depths = [9, 1, 4, 2], [-1, 0, 0, 1], [0, 1, 1, 2]
    assert graft_chain(tokens, parents, depths, [1, 2]) == 0 and tokens == [9, 1, 4, 2]  # the tree holds it
    assert graft_chain(tokens, parents, depths, [1, 2, 7, 8]) == 2
    assert tokens == [9, 1, 4, 2, 7, 8] and parents == [-1, 0, 0, 1, 3, 4] and depths == [0, 1, 1, 2, 3, 4]
    assert graft_chain(tokens, parents, depths, [4, 4]) == 1  # node 2 shared, a child of it appended
    assert parents[-1] == 2 and depths[-1] == 2 and tokens[-1] == 4
    assert graft_chain(tokens, parents, depths, [3]) == 1 and parents[-1] == 0
    anc = ancestor_matrix(np.array(parents), np.array(depths))  # still a tree in tree order
    assert all(p < i for i, p in enumerate(parents) if i)
    assert anc.shape == (len(tokens), len(tokens))
    siblings = {}
    for i in range(1, len(tokens)):
        assert (parents[i], tokens[i]) not in siblings, "two children of one node hold the same token"
        siblings[(parents[i], tokens[i])] = i


@pytest.mark.parametrize("seed", range(4))
def test_chain_added_counts_what_graft_chain_appends_to_each_prefix(seed):
    """For every prefix of a best-first pop order (each a tree) and chains that follow its paths for a while, then
    leave them: chain_added[b] is what graft_chain appends to the first b nodes."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(5, 6, generator=gen).mul(2).log_softmax(dim=-1)  # a small vocabulary: shared prefixes
    parents, depths, ids, _ = best_first_nodes(logprobs, 24)
    tokens = [99] + list(ids)
    rng = np.random.default_rng(seed)
    for _ in range(30):
        node, chain = 0, []
        for _ in range(int(rng.integers(1, 7))):  # down the tree, then off it
            children = [i for i in range(1, len(tokens)) if parents[i] == node]
            if children and rng.random() < 0.8:
                node = int(rng.choice(children))
                chain.append(tokens[node])
            else:
                node = -1
                chain.append(int(rng.integers(0, 6)))
            if node < 0:
                break
        counts = chain_added(parents.tolist(), depths.tolist(), tokens, chain)
        for b in range(len(tokens)):
            tree = tokens[:b + 1], parents[:b + 1].tolist(), depths[:b + 1].tolist()
            assert counts[b] == graft_chain(*tree, chain), (chain, b)


def test_lookup_grafts_accepted_chains_and_stays_exact():
    """On a repetitive prompt the random target repeats itself, the lookup's chains are grafted and accepted, and
    the output is exactly plain decoding's, for fixed and adaptive budgets."""
    target, drafter = random_pair("llama", seed=4, block_size=8)
    prompt = [11, 12, 13, 14, 15] * 6
    reference, _ = run(target, None, prompt, "ar", max_new_tokens=40)
    for method in ("ddtree:1+lookup", "ddtree:4+lookup", "ddtree:auto+lookup"):
        records = []
        tokens, stats = Decoder(target, drafter).generate(prompt, make_method(method, None, None, drafter),
                                                           max_new_tokens=40, trace=records)
        assert tokens == reference, method
        grafted = sum(rec["grafted"] for rec in records)
        accepted = sum(node >= len(rec["parents"]) - rec["grafted"] for rec in records for node in rec["accepted"])
        assert grafted > 0 and accepted > 0, (method, grafted, accepted)
        assert all(rec["draft_logprobs"][-1] == float("-inf") for rec in records if rec["grafted"])


def test_auto_grafts_a_chain_while_its_tier_matches_and_learns_their_yield():
    """ddtree:auto+lookup verifies a chain's added nodes while the yield it has measured for the chain's tier is at
    least GRAFT_FLOOR, however the cost curve prices them: chains that keep missing stop being grafted, one that
    matches what is committed (grafted or not) raises the yield again, and each tier learns its own."""
    _, drafter = random_pair("llama", seed=4, block_size=8)
    method = make_method("ddtree:auto+lookup", None, None, drafter)
    method.cost = CostModel((1, 2, 8), (1.0, 1.1, 1.7), 0.5)
    method._last, method._context = ([math.log(0.6)], [1]), None
    assert method.lookup.tier == 0 and method.graft_yield == [0.5] * 4  # 3 tiers of the context, the table
    assert method.graft_pays([5, 6], 2) and method._chain == ([5, 6], 2, 0)
    method.graft_yield[0] = method.GRAFT_FLOOR  # at the floor: still grafted
    assert method.graft_pays([5, 6], 2)
    method.graft_yield[0] = 0.05
    assert not method.graft_pays([5, 6], 2)
    method.lookup.tier = 2
    assert method.graft_pays([5, 6], 2)  # a long agreement's tier keeps its own yield
    method.lookup.tier = 0
    for _ in range(3):  # a chain that matched nothing committed, past what the drafter's node got
        method._last, method._chain = ([-0.2], [1]), ([5, 6], 2, 0)
        method.observe([0, 1], [7, 8])
    assert method.graft_yield[0] < 0.05 and method.graft_yield[2] == 0.5
    method._last, method._chain = ([-0.2], [1]), ([7, 8, 9], 2, 0)
    method.observe([0, 1], [7, 8, 9])  # the drafter got 1 token, the chain matched 3: 2 more over its 2 nodes
    assert method.graft_yield[0] > 0.25
    assert method.graft_pays([5, 6], 2)


def test_auto_judges_a_chain_once_the_text_reaches_its_end():
    """A chain that was not grafted is judged on the text the next steps commit, not only on its own step's tokens
    (the drafter's and the bonus): judged at once, its later tokens would count as misses."""
    _, drafter = random_pair("llama", seed=4, block_size=8)
    method = make_method("ddtree:auto+lookup", None, None, drafter)
    method.cost = CostModel((1, 2, 8), (1.0, 1.1, 1.7), 0.5)
    method.start([1, 2, 3])
    method._last, method._chain = ([-0.2], [1]), ([4, 5, 6, 7], 4, 0)  # the drafter's node got 4, the bonus was 5
    method.observe([0, 1], [4, 5])
    assert method.graft_yield[0] == 0.5  # 2 of its 4 tokens are in the text so far: not judged yet
    method.observe([0], [6])
    assert method.graft_yield[0] == 0.5
    method.observe([0], [7])  # all 4 right; the drafter had 1 of them: 3 more over its 4 nodes
    assert method.graft_yield[0] == pytest.approx(0.5 + method.GRAFT_ALPHA * (0.75 - 0.5))
    method._chain = ([8, 8], 2, 1)
    method.observe([0], [9])
    method.start([1, 2])  # a new generation: the unjudged chain is dropped
    method.observe([0], [8])
    method.observe([0], [8])
    assert method.graft_yield[1] == 0.5


def test_a_sampled_generation_copies_first_tier_chains_only():
    """Longer chains after longer agreements are for greedy decoding: a sampled generation's lookup stops at the
    first tier's length, and the next greedy one uses every tier again."""
    from ddtree.base.config import SamplingParams

    target, drafter = random_pair("llama", seed=4, block_size=8)
    method = make_method("ddtree:2+lookup", None, None, drafter)
    text = list(range(20, 40))
    for sampling, tier, chain in ((SamplingParams(temperature=1.0), 0, text[10:14]), (None, 2, text[10:20] + [7, 20])):
        method.prepare(target, drafter, sampling)
        method.start(text + [7] + text[:10])
        assert method.lookup.chain() == chain and method.lookup.tier == tier
