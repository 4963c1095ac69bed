"""The drafter's training forward (ddtree/train/model.py): it equals the decoding forward, blocks see their
prefix and themselves, anchors / labels / weights, packed passes equal one pass per sequence."""
import pytest
import torch

from ddtree.models.protocol import reference
from ddtree.bench.testing import random_pair, random_target
from ddtree.train.model import (block_inputs, default_gamma, drafter_block_hidden, loss_weights, sample_anchors,
                                target_features, target_features_packed, visibility_mask)

torch.set_num_threads(1)


def _hidden(drafter, target, tokens, feats, anchors, dense=False):
    block, pos, _ = block_inputs(tokens, anchors, drafter.block_size, drafter.cfg.mask_token_id)
    with torch.no_grad():
        return drafter_block_hidden(drafter, feats, block, pos, anchors, reference(target).model.embed_tokens, dense)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_training_forward_matches_draft(arch):
    target, drafter = random_pair(arch, seed=3, num_draft_layers=2, block_size=8)
    tokens = torch.randint(0, target.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([1, 5, 17, 33, 36, 38])  # the last two run past the end (labels masked)
    logits = target.logits(_hidden(drafter, target, tokens, feats, anchors)[:, 1:])  # [A, B-1, V]
    for j, a in enumerate(anchors.tolist()):
        cache = drafter.new_cache(64)
        drafter.add_context(cache, feats[:a])
        ref = drafter.draft(cache, tokens[a:a + 1], 8)  # [B-1, V]
        torch.testing.assert_close(logits[j], ref, rtol=1e-5, atol=1e-5)


def test_visibility_mask_is_prefix_plus_own_block():
    mask = visibility_mask(torch.tensor([2, 5]), seq_len=7, block_size=3)  # [A*B = 6, T + A*B = 13]
    assert mask.shape == (6, 13)
    for row in range(6):
        j = row // 3
        a = (2, 5)[j]
        assert mask[row, :7].tolist() == [t < a for t in range(7)]  # context strictly before the anchor
        assert mask[row, 7:].tolist() == [r // 3 == j for r in range(6)]  # its own block, both ways


def test_block_sees_only_its_prefix_and_itself():
    target, drafter = random_pair("qwen3", seed=5, num_draft_layers=1, block_size=4)
    tokens = torch.randint(0, target.cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([3, 10, 15])
    base = _hidden(drafter, target, tokens, feats, anchors)
    torch.testing.assert_close(base, _hidden(drafter, target, tokens, feats, anchors, dense=True), rtol=1e-5, atol=1e-5)
    bumped = feats.clone()
    bumped[10:] += 1.0  # context at and after anchor 10: invisible to blocks 0 and 1, visible to block 2
    out = _hidden(drafter, target, tokens, bumped, anchors)
    torch.testing.assert_close(out[:2], base[:2], rtol=0, atol=1e-6)
    assert (out[2] - base[2]).abs().max() > 1e-3
    # other blocks do not leak: dropping block 0 leaves blocks 1 and 2 unchanged
    torch.testing.assert_close(_hidden(drafter, target, tokens, feats, anchors[1:]), base[1:], rtol=1e-5, atol=1e-6)


def test_anchors_labels_and_weights():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(prompt_len=5, seq_len=20, max_anchors=100, generator=gen)
    assert a.tolist() == list(range(5, 19))  # response positions with at least one label, all distinct
    a = sample_anchors(5, 20, 4, gen)
    assert len(a) == 4 and a.unique().numel() == 4 and a.min() >= 5 and a.max() <= 18 and (a.diff() > 0).all()
    assert sample_anchors(1, 20, 100, gen, include_prompt=True).min() == 1
    tokens = torch.arange(10, 30)
    block, pos, labels = block_inputs(tokens, torch.tensor([4, 17]), 4, mask_token_id=99)
    assert block.tolist() == [[14, 99, 99, 99], [27, 99, 99, 99]] and pos.tolist()[1] == [17, 18, 19, 20]
    assert labels.tolist() == [[15, 16, 17], [28, 29, -100]]
    w = loss_weights(16, default_gamma(16))
    assert w[0] == 1.0 and torch.isclose(w[7], torch.exp(torch.tensor(-1.0))) and default_gamma(8) == 4.0


@pytest.mark.parametrize("topk", [0, 5])
def test_packed_target_pass_equals_one_pass_per_sequence(topk):
    """The target's features (and teacher) for a pack of sequences in one pass, as the GPU trainer computes
    them, equal each sequence's own pass: positions restart and no sequence sees another."""
    target = random_target("llama", seed=6)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, target.cfg.vocab_size, (n,), generator=gen) for n in (9, 1, 23, 14)]
    packed = target_features_packed(target, seqs, (1, 4), topk)
    for tokens, got in zip(seqs, packed):
        ref = target_features(target, tokens, (1, 4), topk)
        if topk:
            (got, (got_lp, got_ids)), (ref, (ref_lp, ref_ids)) = got, ref
            torch.testing.assert_close(got_lp, ref_lp, rtol=1e-5, atol=1e-5)
            assert torch.equal(got_ids, ref_ids)
        assert got.shape == (tokens.numel(), 2 * target.cfg.hidden_size)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_packed_visibility_stays_inside_each_sequence():
    starts = torch.tensor([0, 0, 7, 7])
    mask = visibility_mask(torch.tensor([2, 5, 8, 12]), seq_len=14, block_size=2, starts=starts)
    ctx = mask[::2, :14]  # one row per anchor
    assert ctx[0].nonzero().flatten().tolist() == [0, 1]
    assert ctx[1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert ctx[2].nonzero().flatten().tolist() == [7]  # the second sequence starts at 7
    assert ctx[3].nonzero().flatten().tolist() == [7, 8, 9, 10, 11]
