"""The oracle drafts of the GPU benchmark (ddtree/bench/oracle.py): the probe's own path measure, run on the
oracle's ranks, gives back the preset's rates; the logits rank the true token where it was drawn."""
import numpy as np
import pytest
import torch

from ddtree.bench.oracle import FAR, PRESETS, TOP_K, oracle_logits, prob_table, rank_table, sample_ranks
from ddtree.train.probe import path_hit_rates, path_hits


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_probes_path_measure_gives_back_the_presets_rates(name):
    preset, depths = PRESETS[name], 7
    g = torch.Generator().manual_seed(0)
    ranks = np.array([sample_ranks(preset, depths, g) for _ in range(20000)])
    assert set(np.unique(ranks)) <= set(range(TOP_K)) | {FAR}
    assert (ranks[:, 0] == 0).mean() == pytest.approx(preset.rates(1, False)[0], abs=0.015)
    for row in path_hit_rates(path_hits(ranks)):
        for kind in ("spine", "sibling"):
            top1, topk = preset.rates(row["depth"], after_sibling=kind == "sibling")
            measured = row[kind]
            assert measured["roots"] > 500, (row, kind)
            assert measured["top1"] == pytest.approx(top1, abs=0.03), (row["depth"], kind)
            assert measured["topk"] == pytest.approx(topk, abs=0.03), (row["depth"], kind)


def test_a_realistic_oracle_is_right_less_often_after_a_sibling():
    for name in ("embedded", "qwen3-8b-dflash"):
        p = PRESETS[name]
        assert all(p.rates(d, True)[0] < p.rates(d, False)[0] - 0.2 for d in range(2, 17)), name
    opt = PRESETS["optimistic"]
    assert opt.rates(5, True) == opt.rates(5, False)  # the flattering one, kept for comparison


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_drafted_probabilities_fall_with_the_rank(name):
    for depth in range(1, 17):
        probs = PRESETS[name].rank_probs(depth)
        assert sum(probs) == pytest.approx(1.0)
        top = probs[:TOP_K] if PRESETS[name].calibrated else probs[:1]
        assert all(a > b for a, b in zip(top, top[1:])), (name, depth, probs)


@pytest.mark.parametrize("vocab,calibrated", [(12, False), (96, False), (5000, False), (5000, True)])
def test_the_logits_rank_the_true_token_where_it_was_drawn(vocab, calibrated):
    g = torch.Generator().manual_seed(1)
    truth = torch.randint(0, vocab, (400,), generator=g)
    ranks = torch.randint(0, TOP_K + 1, (400,), generator=g).tolist()
    ranks = [FAR if r == TOP_K else r for r in ranks]
    probs = torch.tensor([PRESETS["embedded"].rank_probs(1 + i % 9) for i in range(400)]) if calibrated else None
    logits = oracle_logits(truth, ranks, vocab, g, probs)
    if calibrated:  # the top ranks carry the preset's probabilities, whichever token holds them
        assert torch.allclose(logits.softmax(1).topk(TOP_K).values, probs[:, :TOP_K], atol=2e-3)
    order = logits.argsort(dim=1, descending=True)
    got = (order == truth[:, None]).float().argmax(dim=1).tolist()
    for r, rank in zip(got, ranks):
        assert r == rank if rank != FAR else r >= TOP_K
    top = logits.topk(TOP_K + 1, dim=1).values  # distinct scores: no ties among the top ranks
    assert bool((top[:, :-1] > top[:, 1:]).all())


def test_the_device_tables_hold_what_the_host_draws_give():
    preset = PRESETS["embedded"]
    table = rank_table(preset, 50, 9, torch.Generator().manual_seed(3), "cpu")
    g = torch.Generator().manual_seed(3)
    assert table.tolist() == [sample_ranks(preset, 9, g) for _ in range(50)]
    assert torch.allclose(prob_table(preset, 9, "cpu"), torch.tensor([preset.rank_probs(d) for d in range(1, 10)]))
    assert prob_table(PRESETS["optimistic"], 9, "cpu") is None
    truth = torch.arange(9) * 7
    from_table = oracle_logits(truth, table[0], 5000, torch.Generator().manual_seed(1), prob_table(preset, 9, "cpu"))
    from_list = oracle_logits(truth, table[0].tolist(), 5000, torch.Generator().manual_seed(1),
                              prob_table(preset, 9, "cpu"))
    assert torch.equal(from_table, from_list)
