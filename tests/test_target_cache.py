"""The dequantized-GGUF cache is a valid Hugging Face model directory for every supported transformers."""
import json

import pytest

from ddtree.models import loading
from ddtree.base.config import ModelConfig

V5_STYLE = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


def test_portable_config_writes_rope_theta_where_older_transformers_read_it():
    cfg = loading.portable_config(V5_STYLE)
    assert cfg["rope_theta"] == 100000.0 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama" and cfg["rope_parameters"] == V5_STYLE["rope_parameters"]
    assert "rope_scaling" not in cfg  # a default RoPE needs none
    assert ModelConfig.from_hf(cfg).rope_theta == 100000.0
    scaled = loading.portable_config({**V5_STYLE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3",
                                                                      "factor": 8.0}})
    assert scaled["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0} and scaled["rope_theta"] == 5e5
    assert loading.portable_config(cfg) == cfg  # idempotent


def test_a_conversion_writes_a_portable_config(tmp_path, monkeypatch):
    from ddtree.bench.hf_baseline import to_hf_model
    from ddtree.bench.testing import random_target

    def read_gguf(path):  # a tiny transformers model stands in for the dequantized GGUF
        return to_hf_model(random_target("llama", seed=1)), None

    monkeypatch.setattr(loading, "read_gguf", read_gguf)
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = loading.convert_gguf(gguf)
    assert out == loading.gguf_cache_dir(gguf)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0 and cfg["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.real_model
def test_the_default_target_cache_loads_with_transformers():
    from transformers import AutoConfig

    directory = loading.resolve_target_dir(None)
    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == 100000.0  # SmolLM2's: where transformers 4.x reads it
    hf = AutoConfig.from_pretrained(str(directory))
    theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert theta == 100000.0
