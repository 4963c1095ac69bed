"""Growing a trained drafter (ddtree/train/grow.py): more layers and taps, the same drafts; bad growth refused."""
import pytest
import torch

from ddtree.base.config import ConfigError
from ddtree.bench.testing import random_pair
from ddtree.train.grow import grow_drafter, layers_from_target
from ddtree.train.model import target_features
from ddtree.train.vocab import with_draft_vocab

torch.set_num_threads(1)


def _drafts(drafter, target, tokens, anchor):
    feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
    cache = drafter.new_cache(64)
    drafter.add_context(cache, feats[:anchor])
    return drafter.draft(cache, tokens[anchor:anchor + 1], drafter.block_size)  # [B-1, vocab]


@pytest.mark.parametrize("reduced_vocab", [False, True])
@pytest.mark.parametrize("layers,taps", [(3, None), (2, [0, 1, 3, 4]), (4, [4, 3, 2, 1])])
def test_grown_drafter_drafts_what_it_grew_from(layers, taps, reduced_vocab):
    target, drafter = random_pair("qwen3", seed=11, num_draft_layers=2, block_size=6)
    assert list(drafter.cfg.target_layer_ids) == [1, 3]
    if reduced_vocab:
        drafter = with_draft_vocab(drafter, torch.arange(0, 96, 2), target.model.lm_head.weight)
    tokens = torch.randint(0, target.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    grown = grow_drafter(drafter, layers, taps, seed=5)
    assert grown.cfg.model.num_layers == layers and len(grown.layers) == layers
    assert list(grown.cfg.target_layer_ids) == (taps or [1, 3])
    assert grown.cfg.draft_vocab_size == drafter.cfg.draft_vocab_size
    assert grown.cfg.to_hf()["num_hidden_layers"] == layers
    for anchor in (3, 17, 25):
        before, after = _drafts(drafter, target, tokens, anchor), _drafts(grown, target, tokens, anchor)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        assert torch.equal(after.argmax(-1), before.argmax(-1))
    # the new layers are trainable: their inputs are random, only the output projections start at zero
    new = grown.layers[-1]
    if layers > 2:
        assert new.self_attn.o_proj.weight.abs().max() == 0 and new.mlp.down_proj.weight.abs().max() == 0
        assert new.self_attn.q_proj.weight.std() > 0.01


def test_growth_that_would_lose_weights_is_refused():
    target, drafter = random_pair("qwen3", seed=2, num_draft_layers=2)
    with pytest.raises(ConfigError, match="can only grow"):
        grow_drafter(drafter, layers=1)
    with pytest.raises(ConfigError, match=r"drops the drafter's tap layers \[3\]"):
        grow_drafter(drafter, taps=[1, 2])
    with pytest.raises(ConfigError, match="duplicates"):
        grow_drafter(drafter, taps=[1, 3, 3])
    assert grow_drafter(drafter) is drafter.model  # nothing to grow: the reference as it is


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_from_target_copies_the_named_target_layers(arch):
    target, drafter = random_pair(arch, seed=3, num_draft_layers=2, runtime=False)
    fc_before = drafter.fc.weight.clone()
    q_norm_before = drafter.layers[0].self_attn.q_norm.weight.clone()
    out = layers_from_target(drafter, target, [3, 0])
    assert out is drafter
    for k, i in enumerate([3, 0]):
        mine, source = drafter.layers[k].state_dict(), target.model.layers[i].state_dict()
        for name, value in source.items():
            assert torch.equal(mine[name], value), (k, name)
    assert not torch.equal(drafter.layers[0].self_attn.q_proj.weight, drafter.layers[1].self_attn.q_proj.weight)
    assert torch.equal(drafter.fc.weight, fc_before)  # fc and the head keep their init
    if arch == "llama":  # the target has no q/k norms: the drafter's stay as they were
        assert torch.equal(drafter.layers[0].self_attn.q_norm.weight, q_norm_before)


def test_layers_from_target_refuses_a_wrong_count_or_layer():
    target, drafter = random_pair("qwen3", seed=2, num_draft_layers=2)
    with pytest.raises(ConfigError, match="names 1 target layers for 2 draft layers"):
        layers_from_target(drafter, target, [1])
    with pytest.raises(ConfigError, match=r"\[9\]: the target has layers 0\.\.5"):
        layers_from_target(drafter, target, [1, 9])
