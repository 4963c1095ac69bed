"""The GGUF writer for the llamacpp method: the target's own weights, named and laid out as llama.cpp reads
them, with a template's metadata. Runs without llama.cpp (read back with the gguf package)."""
import numpy as np
import pytest
import torch

from ddtree.base.config import ConfigError
from ddtree.models.gguf_export import permute_rope_rows, write_gguf
from ddtree.bench.testing import random_target


def template(path):
    """A small template GGUF: one metadata string and one array, as a real file's tokenizer fields are."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny template")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_file_type(7)  # dropped: the written file states its own precision
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reading of llama GGUF q/k rows (the inverse the writer must match)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_written_gguf_holds_the_targets_weights(tmp_path, arch):
    import gguf

    target = random_target(arch, seed=4)
    out = write_gguf(target, tmp_path / "t.gguf", template(tmp_path / "template.gguf"))
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.name"].contents() == "tiny template"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert reader.fields["general.file_type"].contents() == 0  # ALL_F32
    tensors = {t.name: np.array(t.data).reshape(list(reversed(t.shape.tolist()))) for t in reader.tensors}
    state = target.model.state_dict()
    assert ("output.weight" in tensors) == (not target.cfg.tie_word_embeddings)
    assert len(tensors) == len(state) - target.cfg.tie_word_embeddings
    cfg = target.cfg
    q, k = tensors["blk.1.attn_q.weight"], tensors["blk.1.attn_k.weight"]
    if arch == "llama":  # interleaved RoPE rows in the file, rotate-half in ours
        q, k = unpermute(q, cfg.num_heads), unpermute(k, cfg.num_kv_heads)
    np.testing.assert_array_equal(q, state["model.layers.1.self_attn.q_proj.weight"].numpy())
    np.testing.assert_array_equal(k, state["model.layers.1.self_attn.k_proj.weight"].numpy())
    np.testing.assert_array_equal(tensors["blk.0.ffn_down.weight"], state["model.layers.0.mlp.down_proj.weight"].numpy())
    np.testing.assert_array_equal(tensors["token_embd.weight"], state["model.embed_tokens.weight"].numpy())
    if arch == "qwen3":
        np.testing.assert_array_equal(tensors["blk.0.attn_q_norm.weight"],
                                      state["model.layers.0.self_attn.q_norm.weight"].numpy())


def test_permutation_is_a_row_shuffle_within_heads():
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of head_dim 8
    p = permute_rope_rows(w, 2)
    assert sorted(p[:8, 0].tolist()) == sorted(w[:8, 0].tolist())  # stays within its head
    np.testing.assert_array_equal(unpermute(p, 2), w)


def test_refuses_a_dtype_llama_cpp_comparison_does_not_cover(tmp_path):
    target = random_target("llama", seed=4, dtype=torch.float64)
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        write_gguf(target, tmp_path / "t.gguf", template(tmp_path / "template.gguf"))
