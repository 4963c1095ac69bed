"""The DFlash drafter: published checkpoint format, incremental context cache, target matching."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ddtree.base.config import ConfigError
from ddtree.runtime.cpu.runtime import attach
from ddtree.models.drafter import DFlashDrafter, default_tap_layers
from ddtree.models.protocol import reference
from ddtree.bench.testing import random_pair, random_target

PUBLISHED_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}" for i in range(2) for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")}


def reference_block_logits(drafter, features, bonus, start, length, masks=None):
    """The published algorithm in one shot, no cache: every layer projects the fused context and the block
    with its own k/v projections, keys get k_norm and RoPE at absolute positions, no causal mask (or, with
    masks, layer i's dense bool mask [length, start + length] over [context ; block])."""
    drafter = reference(drafter)
    target = drafter.target
    ctx = drafter.hidden_norm(drafter.fc(features))  # [start, H]
    block = torch.full((length,), drafter.cfg.mask_token_id)
    block[0] = bonus
    h = target.embed(block)
    pos_ctx, pos_blk = torch.arange(start), torch.arange(start, start + length)
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        cos_c, sin_c = drafter.rotary(pos_ctx, h.dtype)
        cos_b, sin_b = drafter.rotary(pos_blk, h.dtype)
        q = a.query(x, cos_b, sin_b)
        kc, vc = a.key_value(ctx, cos_c, sin_c)
        kb, vb = a.key_value(x, cos_b, sin_b)
        k, v = torch.cat([kc, kb], 1), torch.cat([vc, vb], 1)
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        if masks is not None:
            scores = scores.masked_fill(~masks[i], float("-inf"))
        att = F.softmax(scores, dim=-1) @ v
        h = h + a.output(att)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return target.logits(drafter.norm(h[1:]))


def test_cached_context_matches_one_shot_reference():
    target, drafter = random_pair("qwen3", seed=5, num_draft_layers=2, block_size=6)
    taps = drafter.cfg.target_layer_ids
    features = torch.randn(20, len(taps) * target.cfg.hidden_size)
    cache = drafter.new_cache(40)
    drafter.add_context(cache, features[:12])  # context arrives in pieces, as during decoding
    drafter.add_context(cache, features[12:15])
    drafter.add_context(cache, features[15:])
    ours = drafter.draft(cache, torch.tensor([7]))
    assert cache.length == 20, "the block's own K/V must not be committed"
    ref = reference_block_logits(drafter, features, 7, 20, 6)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(drafter.draft(cache, torch.tensor([7])), ours)  # repeatable: nothing leaked


def test_context_waits_for_the_next_draft():
    """add_context only queues the features on the drafter's own cache (steps that do not draft cost nothing);
    the next draft computes them all, as a cache that computes each piece at once would have."""
    from ddtree.models.kv_cache import KVCache

    target, drafter = random_pair("llama", seed=7, num_draft_layers=2, block_size=6)
    features = torch.randn(9, len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size)
    cache = drafter.new_cache(40)
    drafter.add_context(cache, features[:5])
    drafter.add_context(cache, features[5:])
    assert cache.length == 0 and len(cache.pending) == 2
    queued = drafter.draft(cache, torch.tensor([3]))
    assert cache.length == 9 and not cache.pending
    m = drafter.cfg.model
    at_once = KVCache(m.num_layers, m.num_kv_heads, m.head_dim, 40, torch.float32, "cpu")
    drafter.add_context(at_once, features[:5])
    drafter.add_context(at_once, features[5:])
    assert at_once.length == 9
    torch.testing.assert_close(drafter.draft(at_once, torch.tensor([3])), queued, rtol=1e-5, atol=1e-5)
    cache.reset()
    assert cache.length == 0 and not cache.pending


def test_save_load_round_trip(tmp_path):
    target, drafter = random_pair("llama", seed=6, num_draft_layers=2, block_size=8)
    drafter.model.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == target.cfg.num_layers
    assert cfg["dflash_config"]["target_layer_ids"] == list(drafter.cfg.target_layer_ids)
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 2
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == PUBLISHED_KEYS
    loaded = attach(target, DFlashDrafter.load(tmp_path))[1]  # in the CPU runtime, as the saved one runs
    features = torch.randn(9, len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size)
    outs = []
    for d in (drafter, loaded):
        cache = d.new_cache(32)
        d.add_context(cache, features)
        outs.append(d.draft(cache, torch.tensor([3])))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_loads_hand_made_published_checkpoint(tmp_path):
    """A checkpoint written by hand with the published names and config keys (not by our save())."""
    target = random_target("qwen3", seed=7)
    h, heads, kv, hd, inter = 64, 4, 2, 16, 96
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
        "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "intermediate_size": inter, "vocab_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "block_size": 16,
        "num_target_layers": 6, "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3, 5]},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(2):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                       p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    assert set(shapes) == PUBLISHED_KEYS
    state = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    drafter = DFlashDrafter.load(tmp_path).bind(target)
    assert drafter.cfg.target_layer_ids == (1, 3, 5) and drafter.cfg.mask_token_id == 95
    assert drafter.block_size == 16 and drafter.cfg.model.rope_theta == 1e6
    torch.testing.assert_close(drafter.fc.weight, state["fc.weight"])
    cache = drafter.new_cache(40)
    drafter.add_context(cache, torch.randn(5, 3 * h))
    assert drafter.draft(cache, torch.tensor([1])).shape == (15, 96)


def mismatch(tmp_path, **changes):
    target, drafter = random_pair("llama", seed=8, num_draft_layers=2)
    drafter.model.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return target, tmp_path


@pytest.mark.parametrize("changes,message", [
    ({"vocab_size": 97}, "vocab_size"),
    ({"num_target_layers": 7}, "num_target_layers"),
    ({"target_layer_ids": [1, 9]}, "target_layer_ids"),
    ({"mask_token_id": 96}, "mask_token_id"),
])
def test_mismatched_drafter_is_refused(tmp_path, changes, message):
    target, path = mismatch(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message):
        DFlashDrafter.load(path).bind(target)


def test_hidden_size_mismatch_is_refused(tmp_path):
    target, drafter = random_pair("llama", seed=9)
    other = random_target("llama", seed=9, hidden_size=32, head_dim=8)
    with pytest.raises(ConfigError, match="hidden_size"):
        drafter.model.bind(other)


def test_corrupt_or_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        DFlashDrafter.load(tmp_path)
    target, drafter = random_pair("llama", seed=10)
    drafter.model.save(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ConfigError, match="corrupt"):
        DFlashDrafter.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        DFlashDrafter.load(tmp_path)


def test_default_tap_layers():
    assert default_tap_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_tap_layers(30, 1) == [15]
    assert default_tap_layers(30, 3) == [1, 14, 27]
