"""Fitting a Markov head from draft tables (ddtree/train/markov.py): the tables, their resumable chunks, the fit;
`fit --markov-weight` refusing bad input (the joint loss itself: tests/test_trainer.py)."""
import json

import numpy as np
import pytest
import torch

from ddtree.base.config import ConfigError
from ddtree.models.loading import SHIPPED_DRAFTER
from ddtree.models.markov import MarkovHead
from ddtree.bench.testing import random_pair
from ddtree.train.markov import collect_tables, depth_top1, fit_head, flat_rows, heldout_nll, read_tables


def synthetic_tables(n=3000, depth=4, m=6, vocab=40, seed=0):
    """Roots whose true token at every depth is fixed by its parent (token (3 * parent + 1) % vocab), while the
    'drafter' spreads its mass evenly over the candidates: only a head that reads the parent can predict it."""
    rng = np.random.default_rng(seed)
    parents = rng.integers(0, vocab, (n, depth))
    labels = (3 * parents + 1) % vocab
    cand_ids = np.empty((n, depth, m), dtype=np.int64)
    for i, label in enumerate(labels.reshape(-1)):  # the true token and m - 1 others, in a random order
        others = rng.permutation(np.delete(np.arange(vocab), label))[:m - 1]
        cand_ids.reshape(-1, m)[i] = rng.permutation(np.append(others, label))
    cand_lp = np.full((n, depth, m), np.log(0.9 / m), dtype=np.float16)
    return {"cand_lp": cand_lp, "cand_ids": cand_ids.astype(np.int32), "labels": labels.astype(np.int32),
            "label_lp": np.full((n, depth), np.log(0.9 / m), dtype=np.float32),
            "parents": parents.astype(np.int32), "group": np.array(["s"] * n)}


def test_fit_learns_a_parent_dependence_the_marginals_lack():
    torch.manual_seed(0)
    tables, held = synthetic_tables(), synthetic_tables(n=500, seed=1)
    embed = torch.randn(40, 16)
    head = MarkovHead(16, 40, 4, rank=16, candidates=6)
    rows, hrows = flat_rows(tables), flat_rows(held)
    assert set(rows["depths"].tolist()) == {1, 2, 3}  # position 1 carries no bias, so no rows
    before = heldout_nll(None, embed, hrows)
    assert heldout_nll(head, embed, hrows) == pytest.approx(before, rel=1e-5)  # a fresh head is the identity
    fit_head(head, embed, rows, epochs=20, batch=512, lr=1e-2)
    after = heldout_nll(head, embed, hrows)
    assert after < before - 1.0, (before, after)
    for position, marginal, conditional in depth_top1(head, embed, hrows):
        assert conditional > 0.9 and marginal < 0.5, (position, marginal, conditional)


def test_tables_are_written_in_resumable_chunks(tmp_path):
    target, drafter = random_pair("llama", seed=3, block_size=5)
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(2, 96, (20 + i,), generator=gen).tolist(), 4, "g") for i in range(5)]
    assert collect_tables(target, drafter, seqs, tmp_path / "t", m=6, chunk=2) == 3
    tables = read_tables(tmp_path / "t")
    assert tables["cand_ids"].shape == (sum(len(t) - 1 - 4 for t, _, _ in seqs), 4, 6)
    assert tables["parents"][0, 0] == seqs[0][0][4]  # position 1's parent is the root itself
    assert (tables["parents"][0, 1:] == seqs[0][0][5:8]).all()
    assert collect_tables(target, drafter, seqs, tmp_path / "t", m=6, chunk=2) == 0  # all there: nothing redone
    longer = seqs + seqs[:2]
    assert collect_tables(target, drafter, longer, tmp_path / "t", m=6, chunk=2) == 1  # the same list, extended
    assert json.loads((tmp_path / "t" / "meta.json").read_text()) == {"candidates": 6, "chunk": 2}
    with pytest.raises(ConfigError, match="other settings"):
        collect_tables(target, drafter, seqs, tmp_path / "t", m=8, chunk=2)
    with pytest.raises(FileNotFoundError, match="markov-tables"):
        read_tables(tmp_path / "empty")


@pytest.mark.parametrize("argv, says", [
    (["markov-tables", "--out", "x"], "nothing to tabulate"),
    (["markov-fit", "--tables", "/nonexistent", "--out", "{tmp}/o"], "run `python -m ddtree train markov-tables`"),
    (["markov-fit", "--tables", "t", "--target", "x.gguf", "--out", "{tmp}/o"], "--draft is needed with --target"),
    (["fit", "--data", "d", "--out", "{tmp}/o", "--markov-weight", "1"], "add --markov-rank R"),
    (["fit", "--data", "d", "--out", "{tmp}/o", "--markov-weight", "-1"], "--markov-weight must be >= 0"),
    (["fit", "--data", "d", "--out", "{tmp}/o", "--markov-rank", "8"], "add --markov-weight W"),
    (["fit", "--data", "d", "--out", "{tmp}/o", "--markov-lr", "1e-3"], "drop --markov-lr"),
    (["fit", "--data", "d", "--out", "{tmp}/o", "--resume", "--markov-rank", "8"], "drop --markov-rank"),
    (["fit", "--data", "d", "--out", "{tmp}/o", "--init-from", str(SHIPPED_DRAFTER), "--markov-weight",
      "1", "--markov-rank", "8"], "already has a Markov head")])
def test_markov_commands_refuse_bad_input_before_loading(argv, says, capsys, tmp_path):
    from ddtree.train.cli import main

    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert says in capsys.readouterr().err


def test_quantize_carries_a_head_from_a_drafter_of_the_same_vocabulary(tmp_path, capsys):
    """`train quantize --markov-from DIR`: the donor's head on the rounded drafter; refused for a donor without a
    head or with another block size, and together with --drop-markov."""
    from ddtree.models.drafter import DFlashDrafter
    from ddtree.bench.testing import add_markov_head
    from ddtree.train.cli import main

    _, plain = random_pair("llama", seed=3, block_size=6, runtime=False)
    _, donor = random_pair("llama", seed=4, block_size=6, runtime=False)
    add_markov_head(donor, rank=4, candidates=5, seed=2)
    _, other = random_pair("llama", seed=4, block_size=5, runtime=False)
    add_markov_head(other, seed=2)
    for name, d in (("plain", plain), ("donor", donor), ("other", other)):
        d.save(tmp_path / name)
    assert main(["quantize", "--draft", str(tmp_path / "plain"), "--out", str(tmp_path / "q"),
                 "--markov-from", str(tmp_path / "donor")]) == 0
    got = DFlashDrafter.load(tmp_path / "q")
    assert got.cfg.markov == (4, 5)
    for name in ("proj", "out", "scale"):  # the head is not rounded: the donor's bf16 values as they are
        torch.testing.assert_close(getattr(got.markov, name), getattr(donor.markov, name).bfloat16().float())
    torch.testing.assert_close(got.fc.weight, DFlashDrafter.load(tmp_path / "plain").fc.weight, atol=0.02, rtol=0.05)
    for donor_dir, says in (("plain", "has no Markov head"), ("other", "another draft vocabulary or block size")):
        assert main(["quantize", "--draft", str(tmp_path / "plain"), "--out", str(tmp_path / f"x{donor_dir}"),
                     "--markov-from", str(tmp_path / donor_dir)]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", "--draft", "a", "--out", "b", "--markov-from", "c", "--drop-markov"])
