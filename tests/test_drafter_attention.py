"""Attention options of newer published drafters: layer_types + sliding_window, dflash_config use_swa /
swa_window_size / causal. Parsed, applied (checked against a dense-mask reference), exported, and refused when
ddtree cannot apply them."""
import dataclasses
import json

import pytest
import torch

from conftest import run
from ddtree.base.config import ConfigError
from ddtree.models.drafter import DFlashDrafter, DrafterConfig
from ddtree.models.protocol import reference
from ddtree.bench.testing import random_pair
from test_drafter import reference_block_logits

START, BLOCK = 14, 6

# (options, expected (window, causal) per layer, as the published conventions define them)
VARIANTS = {
    "layer_types": (dict(layer_types=("sliding_attention", "full_attention"), sliding_window=4),
                    [(4, True), (None, False)]),
    "use_swa": (dict(swa_window=3), [(3, False), (3, False)]),
    "causal": (dict(causal=True), [(None, True), (None, True)]),
}


def with_options(drafter, **options):
    """The same weights under other attention options."""
    other = DFlashDrafter(dataclasses.replace(drafter.cfg, **options))
    other.load_state_dict(reference(drafter).state_dict())
    other.label = "options"
    return other.eval().bind(drafter.target)


def dense_mask(window, causal, start, length):
    """Element by element: may block query i (position start + i) see key j (position j) of [context ; block]?"""
    mask = torch.zeros(length, start + length, dtype=torch.bool)
    for i in range(length):
        for j in range(start + length):
            d = start + i - j
            mask[i, j] = (d >= 0 or not causal) and (window is None or (d < window if causal else abs(d) < window))
    return mask


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_windowed_drafter_matches_dense_mask_reference(variant):
    options, expected = VARIANTS[variant]
    _, base = random_pair("qwen3", seed=5, num_draft_layers=2, block_size=BLOCK)
    drafter = with_options(base, **options)
    assert [drafter.cfg.layer_attention(i) for i in range(2)] == expected
    features = torch.randn(START, len(drafter.cfg.target_layer_ids) * drafter.cfg.model.hidden_size,
                           generator=torch.Generator().manual_seed(0))
    cache = drafter.new_cache(40)
    drafter.add_context(cache, features[:9])
    drafter.add_context(cache, features[9:])
    ours = drafter.draft(cache, torch.tensor([7]))
    masks = [dense_mask(w, c, START, BLOCK) for w, c in expected]
    torch.testing.assert_close(ours, reference_block_logits(drafter, features, 7, START, BLOCK, masks),
                               rtol=1e-4, atol=1e-4)
    # the options matter here: the original all-visible drafter computes something else
    assert not torch.allclose(ours, reference_block_logits(drafter, features, 7, START, BLOCK), atol=1e-3)


def test_options_round_trip_through_the_published_format(tmp_path):
    _, base = random_pair("qwen3", seed=2, num_draft_layers=2, block_size=BLOCK)
    for name, (options, _) in VARIANTS.items():
        with_options(base, **options).save(tmp_path / name)
        raw = json.loads((tmp_path / name / "config.json").read_text())
        loaded = DFlashDrafter.load(tmp_path / name)
        assert loaded.cfg == dataclasses.replace(base.cfg, **options), name
        if name == "use_swa":
            assert raw["dflash_config"]["use_swa"] is True and raw["dflash_config"]["swa_window_size"] == 3
    # a Qwen3 config with use_sliding_window and no layer_types: layers from max_window_layers on slide
    raw = base.cfg.to_hf()
    raw.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    cfg = DrafterConfig.from_hf(raw)
    assert [cfg.layer_attention(i) for i in range(2)] == [(None, False), (5, True)]


@pytest.mark.parametrize("change, message", [
    (lambda c: c["dflash_config"].update(selector_rank=8), r"does not understand: \['selector_rank'\]"),
    (lambda c: c["dflash_config"].update(use_swa=True), "use_swa without swa_window_size"),
    (lambda c: c["dflash_config"].update(input_embedding_scale=2.0), "input_embedding_scale=2.0 is not supported"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types has 1 entries for 2 layers"),
    (lambda c: c.update(layer_types=["full_attention", "linear_attention"]), r"\['linear_attention'\]"),
    (lambda c: c["dflash_config"].update(causal="yes"), "causal must be true or false"),
])
def test_options_it_cannot_apply_are_refused(change, message):
    _, base = random_pair("qwen3", seed=2, num_draft_layers=2, block_size=BLOCK)
    raw = json.loads(json.dumps(base.cfg.to_hf()))
    change(raw)
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_hf(raw)


@pytest.mark.slow
def test_windowed_drafter_stays_lossless():
    """The sliding / causal options change what is drafted (the drafter's own draft() runs here, no oracle),
    never what is emitted."""
    target, base = random_pair("llama", seed=3, num_draft_layers=2, block_size=8, init_scale=0.25)
    for options, _ in VARIANTS.values():
        drafter = with_options(base, **options)
        for prompt in ([5, 6, 7], list(range(3, 30))):
            reference, _ = run(target, None, prompt, "ar", max_new_tokens=24)
            for method, budget in [("dflash", 1), ("ddtree", 16)]:
                assert run(target, drafter, prompt, method, budget, max_new_tokens=24)[0] == reference
