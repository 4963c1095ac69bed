"""The offline acceptance probe: its tree walk by hand, and on the real pair against the engine's own steps."""
import warnings

import numpy as np
import pytest

from ddtree.models.protocol import reference
from ddtree.bench.testing import add_markov_head, random_pair
from ddtree.train.probe import (SIBLING_RANKS, path_hit_rates, path_hits, accepted_lengths, anchor_drafts, anchor_tables, block_drafts, head_accepted_lengths,
                                probe, tree_tau)


def test_accepted_lengths_by_hand():
    # depth 1: ranks 0/1 with p .6/.3; depth 2: .55/.4; depth 3: .9/.05. Best-first pop order (path probability):
    # (0) .6, (0,0) .33, (1) .3, (0,0,0) .297, (0,1) .24
    lp = np.log(np.array([[.6, .3], [.55, .4], [.9, .05]], dtype=np.float32))
    budgets = [1, 2, 3, 4, 5]
    assert accepted_lengths(lp, np.array([0, 0, 0]), budgets) == [1, 2, 2, 3, 3]
    assert accepted_lengths(lp, np.array([1, 0, 0]), budgets) == [0, 0, 1, 1, 1]  # (1, 0) never pops here
    assert accepted_lengths(lp, np.array([0, 1, 1]), budgets) == [1, 1, 1, 1, 2]
    assert accepted_lengths(lp, np.array([2, 0, 0]), budgets) == [0] * 5  # the true token is outside the top-k


def test_path_hits_by_hand():
    assert SIBLING_RANKS == 4
    ranks = np.array([[0, 0, 0],    # the spine all along
                      [1, 0, 5],    # a sibling at depth 1, then the top-1; depth 3 outside the top 4
                      [2, 3, 0],    # siblings at depths 1 and 2, then the top-1
                      [9, 0, 0],    # outside the top 4 at depth 1: counted nowhere
                      [0, 6, 0]])   # the spine, then out: depth 3 not counted
    counts = path_hits(ranks)
    # depth 2: spine parents (rows 0, 4): one top-1, one miss; sibling parents (rows 1, 2): one top-1, one top-4
    assert counts[0].tolist() == [[2, 1, 1], [2, 1, 2]]
    # depth 3: spine parent row 1 (rank 5: a miss) and row 0 (hit); sibling parent row 2 (hit)
    assert counts[1].tolist() == [[2, 1, 1], [1, 1, 1]]
    rates = path_hit_rates(counts)
    assert rates[0] == {"depth": 2, "spine": {"roots": 2, "top1": 0.5, "topk": 0.5},
                        "sibling": {"roots": 2, "top1": 0.5, "topk": 1.0}}
    assert path_hit_rates(np.zeros((1, 2, 3), dtype=np.int64))[0]["sibling"]["top1"] is None


def test_tables_give_the_probes_tau_with_and_without_a_head():
    """The Markov head's tables (anchor_tables + tree_tau) measure what probe() measures, on a random pair; with
    a head, probe() builds the engine's conditional trees, and tree_tau the same ones from the tables (here all
    budgets draw on the tables' 8 candidates, and no near-tie falls to the tables' fp16)."""
    import torch

    target, drafter = random_pair("qwen3", seed=6, block_size=6, init_scale=0.3)
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(2, 96, (30 + 7 * i,), generator=gen).tolist(), 5 + i, f"g{i % 2}") for i in range(4)]
    budgets = (1, 3, 8)
    for head in (False, True):
        if head:
            add_markov_head(drafter, rank=4, candidates=8, seed=3, strength=0.5)
        want = probe(target, drafter, seqs, budgets, k=8)
        parts = []
        for tokens, plen, group in seqs:
            tables = anchor_tables(block_drafts(target, drafter, tokens, plen), tokens, 8)
            tables["group"] = np.array([group] * len(tables["labels"]))
            parts.append(tables)
        tables = {k: np.concatenate([t[k] for t in parts]) for k in parts[0]}
        got = tree_tau(tables, budgets, drafter.markov, reference(target).model.embed_tokens.weight, drafter.to_target_ids)
        assert got.keys() == want.keys()
        for g in got:
            assert got[g]["positions"] == want[g]["positions"]
            assert got[g]["top1"] == pytest.approx(want[g]["top1"])
            assert got[g]["tau"] == pytest.approx(want[g]["tau"])
    assert tables["labels"].shape[1] == 5 and (tables["labels"] >= 0).any()


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("budget", [8, 16])
@pytest.mark.parametrize("head", [False, True], ids=["marginals", "markov-head"])
def test_probe_accepts_what_decoding_accepts(budget, head):
    """Decoding ddtree:budget greedily lands on some positions of the target's own answer; at each one the probe's
    tree accepts exactly what the engine's step accepted. (From budget 7 on the engine drafts the whole block, as
    the probe does; below it drafts budget + 1 positions, whose distributions differ slightly: engine.DDTree.)"""
    import ddtree

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pair = ddtree.load(dtype="float32", device="cpu")
    if head:  # a random head: other trees, the probe's again the engine's own
        add_markov_head(pair.drafter, rank=8, seed=1, strength=0.3)
    steps = 0
    for prompt in ["Write a Python function that reverses a string.", "Describe a quiet harbor at dawn."]:
        ref = pair.generate(prompt, method="ar", max_new_tokens=48)
        run = pair.generate(prompt, method="ddtree", budget=budget, max_new_tokens=48)
        assert run.token_ids == ref.token_ids
        tokens, plen = ref.prompt_ids + ref.token_ids, len(ref.prompt_ids)
        drafts = anchor_drafts(pair.target, pair.drafter, tokens, plen)
        blocks = block_drafts(pair.target, pair.drafter, tokens, plen)
        root = plen  # a step's root is the last committed token: first the prefill's, at position plen
        for committed in run.stats.acceptance_lengths[:-1]:  # the last step may be cut by max_new_tokens
            i = root - plen
            if head:
                got = head_accepted_lengths(pair.drafter, blocks.logprobs[i], tokens[root], blocks.labels[i].numpy(),
                                            [budget])
            else:
                got = accepted_lengths(drafts.logprobs[i], drafts.ranks[i], [budget])
            assert got == [committed - 1], root
            root += committed
            steps += 1
    assert steps >= 20


@pytest.mark.parametrize("argv, says", [(["--data", "x", "--budgets", "1,64"], "--budgets must lie in 1..--top-k"),
                                        ([], "nothing to probe")])
def test_probe_cli_rejects_bad_input_before_loading(argv, says, capsys):
    from ddtree.train.cli import main

    assert main(["probe", *argv]) == 2
    assert says in capsys.readouterr().err
