"""A reduced draft vocabulary (config draft_vocab_size, own lm_head, d2t offsets as vLLM loads them) and the
distillation loss: checkpoint format, lossless decoding at T = 0 and T > 0, loss identities and gradients."""
import json

import pytest
import torch
from safetensors import safe_open

from conftest import plant_oracle
from ddtree.base.config import SamplingParams
from ddtree.models.drafter import DFlashDrafter, untrained_drafter
from ddtree.engine.decoder import Decoder, make_method
from ddtree.bench.testing import random_pair, random_target
from ddtree.train.fused_ce import head_soft_cross_entropy
from ddtree.train.model import DraftLoss, sample_anchors, target_features
from ddtree.train.vocab import coverage, draft_vocabulary, pruned_draft_vocab, with_draft_vocab
from ddtree.train.data import Sequence

VOCAB_IDS = torch.tensor(sorted(set(range(0, 96, 3)) | set(range(40, 70))))  # 52 of 96 target ids


def test_checkpoint_has_vllm_names_and_round_trips(tmp_path):
    target = random_target("qwen3", seed=2, init_scale=0.25)
    drafter = untrained_drafter(target, 2, 8, seed=3, draft_vocab=VOCAB_IDS)
    drafter.save(tmp_path, torch.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == len(VOCAB_IDS)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (len(VOCAB_IDS), target.cfg.hidden_size)
        d2t = f.get_tensor("d2t")
    assert d2t.dtype == torch.int64 and (torch.arange(len(VOCAB_IDS)) + d2t).tolist() == VOCAB_IDS.tolist()
    loaded = DFlashDrafter.load(tmp_path, torch.bfloat16).bind(target.model.to(torch.bfloat16))
    drafter = drafter.to(torch.bfloat16)
    cache_a, cache_b = drafter.new_cache(32), loaded.new_cache(32)
    feats = torch.randn(5, len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size, dtype=torch.bfloat16)
    for d, c in ((drafter, cache_a), (loaded, cache_b)):
        d.add_context(c, feats)
    a, b = drafter.draft(cache_a, torch.tensor([7])), loaded.draft(cache_b, torch.tensor([7]))
    assert a.shape == (7, len(VOCAB_IDS))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert loaded.to_target_ids(a.argmax(-1)).tolist() == VOCAB_IDS[a.argmax(-1)].tolist()


def test_reduced_head_equals_the_full_heads_columns():
    target, full = random_pair("llama", seed=5, num_draft_layers=2, block_size=8, init_scale=0.25)
    reduced = with_draft_vocab(full, VOCAB_IDS, target.model.lm_head.weight)
    cache_a, cache_b = full.new_cache(32), reduced.new_cache(32)
    feats = torch.randn(4, len(full.cfg.target_layer_ids) * target.cfg.hidden_size)
    full.add_context(cache_a, feats)
    reduced.add_context(cache_b, feats)
    torch.testing.assert_close(reduced.draft(cache_b, torch.tensor([3])), full.draft(cache_a, torch.tensor([3]))[:, VOCAB_IDS])


def test_another_draft_vocabulary_drops_a_markov_head():
    """A Markov head reads its draft vocabulary's ids: with_draft_vocab leaves it out (fit --draft-vocab on a drafter
    with one), and the rest of the drafter carries over."""
    from ddtree.bench.testing import add_markov_head

    target, full = random_pair("llama", seed=5, num_draft_layers=2, block_size=8, init_scale=0.25)
    reduced = with_draft_vocab(add_markov_head(full, rank=4), VOCAB_IDS, target.model.lm_head.weight)
    assert full.markov is not None and reduced.markov is None and reduced.cfg.markov is None
    torch.testing.assert_close(reduced.fc.weight, full.model.fc.weight, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_reduced_vocab_drafter_is_lossless_greedy(arch):
    target, full = random_pair(arch, seed=11, num_draft_layers=2, block_size=8, init_scale=0.25)
    reduced = with_draft_vocab(full, VOCAB_IDS, target.model.lm_head.weight)
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for i in range(6):
        prompt = torch.randint(0, 96, (3 + i,), generator=gen).tolist()
        ref, _ = Decoder(target).generate(prompt, make_method("ar"), max_new_tokens=32)
        plant_oracle(full, prompt + ref, seed=i)  # deep, branchy acceptance over the full vocabulary ...
        reduced.draft = lambda cache, bonus, length=None: full.draft(cache, bonus, length)[:, VOCAB_IDS]  # ... seen
        for method, budget in (("dflash", 1), ("ddtree", 4), ("ddtree", 24)):  # through the reduced one
            out, stats = Decoder(target, reduced).generate(prompt, make_method(method, budget, None, reduced),
                                                           max_new_tokens=32)
            assert out == ref, (method, budget, i)
            accepted += sum(n - 1 for n in stats.acceptance_lengths)
        del full.draft, reduced.draft
    assert accepted > 40  # the drafts really were accepted, through the d2t mapping


@pytest.mark.slow
def test_reduced_vocab_drafter_samples_the_target_distribution():
    from test_sampling import SAMPLES, VOCAB, chi_square_rejects, exact_distribution, sample_counts

    target, full = random_pair("llama", seed=21, block_size=4, vocab_size=VOCAB, init_scale=0.6)
    reduced = with_draft_vocab(full, torch.tensor([0, 2, 3, 5]), target.model.lm_head.weight)
    params = SamplingParams(1.0)
    counts = sample_counts(Decoder(target, reduced), make_method("ddtree", 6, None, reduced), params)
    rejected, stat, critical = chi_square_rejects(counts, exact_distribution(target, params), SAMPLES)
    assert not rejected, f"chi-square {stat:.1f} > critical {critical:.1f}"


def test_vocabulary_is_the_most_frequent_response_tokens():
    seqs = [Sequence([1, 2, 9, 9, 9, 4, 4, 7], 2, "a", "x"), Sequence([3, 9, 4, 5], 1, "b", "x")]
    from ddtree.train.vocab import response_token_counts

    counts = response_token_counts(seqs, 12)
    assert draft_vocabulary(counts, 2).tolist() == [4, 9]
    assert draft_vocabulary(counts, 3, always=(11,)).tolist() == [4, 9, 11]
    assert coverage(torch.tensor([4, 9]), seqs) == pytest.approx(7 / 9)
    with pytest.raises(ValueError, match="within"):
        draft_vocabulary(counts, 0)


# --- distillation ------------------------------------------------------------------------------------------
def _soft_reference(hidden, weight, idx, w):
    logp = (hidden @ weight.T).float().log_softmax(-1)
    return -(logp.gather(1, idx) * w).sum(-1)


@pytest.mark.parametrize("k", [1, 5])
def test_soft_cross_entropy_matches_autograd(k):
    gen = torch.Generator().manual_seed(k)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen)
    idx = torch.randint(0, 50, (37, k), generator=gen)
    w = torch.rand(37, k, generator=gen)
    labels = idx[:, 0]
    loss, hit = head_soft_cross_entropy(hidden, weight, idx, w, labels, chunk=8)
    ref = _soft_reference(hidden, weight, idx, w)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(37, generator=gen)
    (grad,) = torch.autograd.grad((loss * g).sum(), hidden)
    (grad_ref,) = torch.autograd.grad((ref * g).sum(), hidden)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-5)
    assert hit.tolist() == ((hidden @ weight.T).argmax(-1) == labels).tolist()


def test_distillation_of_a_one_hot_teacher_is_the_hard_loss():
    target, drafter = random_pair("qwen3", seed=4, num_draft_layers=1, block_size=6, init_scale=0.25)
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
    anchors = sample_anchors(8, 40, 10, torch.Generator().manual_seed(2))
    k = 3  # teacher = the next token with log-prob 0, plus two zero-probability entries
    nxt = torch.cat([tokens[1:], tokens[:1]])
    teacher = (torch.tensor([0.0, -torch.inf, -torch.inf]).expand(40, k).clone(),
               torch.stack([nxt, (nxt + 1) % 96, (nxt + 2) % 96], dim=1))
    hard, _ = DraftLoss(drafter, target, distill=0.0)(tokens, feats, anchors)
    for distill in (0.5, 1.0):
        soft, _ = DraftLoss(drafter, target, distill=distill)(tokens, feats, anchors, teacher=teacher)
        torch.testing.assert_close(soft, hard, rtol=1e-5, atol=1e-6)


def test_a_pruned_draft_vocabulary_keeps_the_drafters_columns_and_its_markov_head():
    """pruned_draft_vocab: the drafter's logits at the kept draft ids (its own trained head's rows, not the target's;
    within float32 rounding: the product's blocking depends on the head's size), d2t for their target ids, and the Markov head's columns for them; the layers carried over."""
    from ddtree.bench.testing import add_markov_head

    target = random_target("qwen3", seed=2, init_scale=0.25)
    drafter = add_markov_head(untrained_drafter(target, 2, 8, seed=3, draft_vocab=VOCAB_IDS), rank=4)
    with torch.no_grad():
        drafter.lm_head.weight.add_(torch.randn_like(drafter.lm_head.weight))  # its own rows, not the target's
        drafter.markov.out.normal_()
    keep = torch.tensor([0, 3, 4, 10, 30, len(VOCAB_IDS) - 1])
    pruned = pruned_draft_vocab(drafter, keep)
    assert pruned.cfg.draft_vocab_size == len(keep) and pruned.cfg.markov == drafter.cfg.markov
    assert pruned.to_target_ids(torch.arange(len(keep))).tolist() == VOCAB_IDS[keep].tolist()
    assert torch.equal(pruned.markov.out, drafter.markov.out[:, keep])
    assert torch.equal(pruned.fc.weight, drafter.fc.weight)
    feats = torch.randn(5, len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size)
    caches = drafter.new_cache(32), pruned.new_cache(32)
    for d, c in zip((drafter, pruned), caches):
        d.add_context(c, feats)
    torch.testing.assert_close(pruned.draft(caches[1], torch.tensor([7])),
                               drafter.draft(caches[0], torch.tensor([7]))[:, keep], rtol=1e-6, atol=1e-5)
    for bad in (torch.tensor([3, 1]), torch.tensor([0, 0]), torch.tensor([len(VOCAB_IDS)]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match="distinct draft ids in ascending order"):
            pruned_draft_vocab(drafter, bad)
    with pytest.raises(ValueError, match="whole vocabulary"):
        pruned_draft_vocab(untrained_drafter(target, 2, 8, seed=3), keep)


def test_prune_vocab_keeps_the_most_frequent_answer_tokens_and_the_stop_token(tmp_path, monkeypatch):
    """`train prune-vocab`: the --size draft tokens most frequent in --data's training answers, the target's stop
    tokens always among them, written in the published format; a drafter pruned this way decodes like any other
    (every method equals ar); bad requests are refused with exit code 2 before anything is written."""
    from ddtree.train import cli
    from conftest import run

    target = random_target("qwen3", seed=2, init_scale=0.25)
    drafter = untrained_drafter(target, 2, 8, seed=3, draft_vocab=VOCAB_IDS)
    drafter.save(tmp_path / "src", torch.bfloat16)
    stop = int(VOCAB_IDS[-1])  # a rare token: kept only because it stops answers
    answers = [[40, 41, 41, 42, 42, 42, 0, 3, stop], [41, 42, 6, 6, 6, 6, 0, 3]]
    monkeypatch.setattr(cli, "_load_target", lambda args: (target, None, [stop], None))
    monkeypatch.setattr(cli, "read_sequences", lambda dirs, split: [Sequence([1, 2] + a, 2, "k", "s") for a in answers])
    out = tmp_path / "pruned"
    args = ["prune-vocab", "--draft", str(tmp_path / "src"), "--data", "d", "--size", "6", "--out", str(out)]
    assert cli.main(args) == 0
    pruned = DFlashDrafter.load(out, target=target)
    kept = pruned.to_target_ids(torch.arange(6)).tolist()
    assert kept == sorted([0, 3, 6, 41, 42, stop]), kept  # 6 x4, 42 x4, 41 x3, 0 x2, 3 x2, and the stop token
    for prompt in ([5, 9, 2], [40, 41, 42, 43, 44]):
        reference, _ = run(target, None, prompt, "ar", max_new_tokens=16)
        for method, budget in (("dflash", None), ("ddtree", 4)):
            assert run(target, pruned, prompt, method, budget=budget or 1, max_new_tokens=16)[0] == reference
    assert cli.main(args) == 2  # --out holds a drafter: needs --force
    assert cli.main(args[:-2] + ["--out", str(tmp_path / "x"), "--size", str(len(VOCAB_IDS))]) == 2  # nothing pruned
    assert not (tmp_path / "x").exists()
