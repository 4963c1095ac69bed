"""A drafter as written here (drafter.save: what `train export`, `quantize` and `markov-fit` write) holds exactly
what vLLM's and SGLang's DFlash loaders read (docs/serving.md), as read from their public code:

- vLLM (vllm/model_executor/models/qwen3_dflash.py, DFlashQwen3ForCausalLM.load_weights): every tensor name must
  map to a parameter (its AutoWeightsLoader raises "There is no module or parameter named ..." otherwise); it
  skips `t2d`, renames `d2t` to draft_id_to_target_id, and takes `embed_tokens` only when present. A Markov head's
  `markov.*` tensors are therefore refused: a drafter for vLLM is written without them.
- SGLang (python/sglang/srt/models/dflash.py, DFlashDraftModel.load_weights): loads layers.*, fc, hidden_norm and
  norm, and silently ignores every other name (lm_head, d2t, markov.*): it drafts with the target's own embedding
  and LM head, over the full vocabulary.
The name sets below restate those contracts; they are not the engines' code."""
import json
import re

import pytest
import torch
from safetensors import safe_open

from ddtree.models.drafter import DFlashDrafter, untrained_drafter
from ddtree.models.loading import SHIPPED_DRAFTER
from ddtree.models.markov import CONFIG_KEY as MARKOV_KEY
from ddtree.bench.testing import add_markov_head, random_target

LAYER = r"layers\.\d+\."
LAYER_TENSORS = [LAYER + n for n in (
    r"input_layernorm\.weight", r"post_attention_layernorm\.weight",
    r"self_attn\.[qkvo]_proj\.weight", r"self_attn\.[qk]_norm\.weight", r"mlp\.(gate|up|down)_proj\.weight")]
# names each loader takes into a parameter
SGLANG_LOADS = LAYER_TENSORS + [r"fc\.weight", r"hidden_norm\.weight", r"norm\.weight"]
VLLM_LOADS = SGLANG_LOADS + [r"lm_head\.weight", r"d2t", r"embed_tokens\.weight"]
VLLM_SKIPS = [r"t2d"]
# config keys the loaders read (the Qwen3 layer shapes, and the DFlash fields)
MODEL_KEYS = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "hidden_act", "attention_bias"}
DFLASH_KEYS = {"block_size", "num_target_layers"}
DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids"}


def matches(name: str, patterns) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def tensors(directory) -> dict[str, tuple]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def check_engine_format(directory, target_cfg=None) -> dict:
    """The checks both engines need; returns the config."""
    cfg = json.loads((directory / "config.json").read_text())
    names = tensors(directory)
    assert MODEL_KEYS | DFLASH_KEYS <= set(cfg), sorted(MODEL_KEYS | DFLASH_KEYS - set(cfg))
    assert DFLASH_CONFIG_KEYS <= set(cfg["dflash_config"])
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["hidden_act"] == "silu"
    refused = [n for n in names if not matches(n, VLLM_LOADS + VLLM_SKIPS)]
    assert not refused, f"vLLM's loader raises on {refused}"
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    assert names["fc.weight"][0] == (h, h * len(cfg["dflash_config"]["target_layer_ids"]))
    for i in range(layers):  # every layer complete: the loaders leave no parameter unset
        assert sum(n.startswith(f"layers.{i}.") for n in names) == 11
    assert not any(n.startswith(f"layers.{layers}.") for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(names)
    if "draft_vocab_size" in cfg:  # reduced vocabulary: vLLM's lm_head is [draft_vocab_size, H], d2t its offsets
        v = cfg["draft_vocab_size"]
        assert names["lm_head.weight"][0] == (v, h) and names["d2t"] == ((v,), "I64")
    else:  # the full vocabulary: no head of its own (vLLM and SGLang use the target's)
        assert "lm_head.weight" not in names and "d2t" not in names
    if target_cfg is not None:
        assert cfg["vocab_size"] == target_cfg.vocab_size and cfg["num_target_layers"] == target_cfg.num_layers
    return cfg


@pytest.mark.parametrize("draft_vocab", [None, torch.tensor(sorted(set(range(0, 96, 3)) | {5, 7}))])
def test_saved_drafters_hold_what_the_engines_load(tmp_path, draft_vocab):
    target = random_target("qwen3", seed=1)
    drafter = untrained_drafter(target, 2, 8, seed=2, draft_vocab=draft_vocab)
    drafter.save(tmp_path, torch.bfloat16)
    cfg = check_engine_format(tmp_path, target.cfg)
    assert ("draft_vocab_size" in cfg) == (draft_vocab is not None)
    names = tensors(tmp_path)
    assert [n for n in names if not matches(n, SGLANG_LOADS)] == ([] if draft_vocab is None else
                                                                 ["d2t", "lm_head.weight"])  # SGLang ignores these


def test_a_markov_head_is_kept_by_ddtree_and_must_be_dropped_for_vllm(tmp_path):
    target = random_target("qwen3", seed=1)
    drafter = add_markov_head(untrained_drafter(target, 1, 8, seed=2))
    drafter.save(tmp_path / "with-head", torch.bfloat16)
    names = tensors(tmp_path / "with-head")
    head = sorted(n for n in names if n.startswith("markov."))
    assert head and not any(matches(n, VLLM_LOADS + VLLM_SKIPS) for n in head)  # vLLM would raise on these
    assert not any(matches(n, SGLANG_LOADS) for n in head)  # SGLang drops them silently
    cfg = json.loads((tmp_path / "with-head" / "config.json").read_text())
    assert MARKOV_KEY in cfg and MARKOV_KEY not in cfg["dflash_config"]  # outside what the engines parse
    # the copy for the engines (docs/serving.md): the same drafter without the head
    copy = DFlashDrafter.load(tmp_path / "with-head")
    copy.set_markov_head(None)
    copy.save(tmp_path / "engines", torch.bfloat16)
    check_engine_format(tmp_path / "engines", target.cfg)
    assert MARKOV_KEY not in json.loads((tmp_path / "engines" / "config.json").read_text())
    assert set(tensors(tmp_path / "engines")) == set(names) - set(head)


def test_the_shipped_drafter(tmp_path):
    """The shipped drafter carries a Markov head: without it, exactly vLLM's names."""
    names = tensors(SHIPPED_DRAFTER)
    assert {n for n in names if n.startswith("markov.")} == {"markov.proj", "markov.out", "markov.scale"}
    drafter = DFlashDrafter.load(SHIPPED_DRAFTER)
    drafter.set_markov_head(None)
    drafter.save(tmp_path, torch.bfloat16)
    cfg = check_engine_format(tmp_path)
    assert cfg["draft_vocab_size"] == 4096 and cfg["block_size"] == 8
    assert 2 in drafter.to_target_ids(torch.arange(4096)).tolist()  # <|im_end|>, SmolLM2's stop token: draftable
