"""The fused inference layout (ddtree/models/fused.py) against the separate-projection reference: same logits, same
tokens for every method, an unchanged state dict, and a layout that survives .to()."""

import pytest
import torch

from conftest import assert_same_tokens
from ddtree.models.attention import Visibility
from ddtree.bench.testing import random_pair, random_target

ARCHS = ["llama", "qwen2", "qwen3"]  # qwen2: q/k/v biases; qwen3: per-head q/k norms


def logits(target, tokens: list[int], extra: list[int]):
    """Prefill `tokens`, then one pass over `extra` as a causal chain: its logits [len(extra), V]."""
    cache = target.new_cache(64)
    ids = torch.tensor(tokens)
    target(ids, torch.arange(len(tokens)), cache, Visibility.causal(0, len(tokens), "cpu"))
    cache.commit(len(tokens))
    n = len(extra)
    out = target(torch.tensor(extra), torch.arange(len(tokens), len(tokens) + n), cache,
                 Visibility.causal(len(tokens), n, "cpu"))
    return out.logits


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_forward_matches_reference(arch):
    fused = random_target(arch, seed=3, init_scale=0.25, runtime=False)
    ref = random_target(arch, seed=3, init_scale=0.25, fused=False, runtime=False)
    assert fused.fused and not ref.fused
    for extra in ([5], [5, 17, 40, 2, 9]):
        torch.testing.assert_close(logits(fused, [1, 2, 3, 4], extra), logits(ref, [1, 2, 3, 4], extra),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_tokens_equal_reference_tokens(arch):
    """ar, dflash and ddtree decode the same tokens on the fused and the reference layout (fp32)."""
    fused_pair = random_pair(arch, seed=11, num_draft_layers=2, init_scale=0.25)
    ref_pair = random_pair(arch, seed=11, num_draft_layers=2, init_scale=0.25, fused=False)
    assert_same_tokens(fused_pair, ref_pair, "the fused and the reference layout", seed=7)


def test_fusing_keeps_the_state_dict_and_stores_nothing_twice():
    ref = random_target("qwen2", seed=1, fused=False, runtime=False)
    fused = random_target("qwen2", seed=1, runtime=False)
    a, b = ref.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    attn = fused.model.layers[0].self_attn
    # q/k/v_proj's weights and biases are views of the fused tensors
    assert attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()
    v_start = (attn.num_heads + attn.num_kv_heads) * attn.head_dim  # q rows, then k rows, then v rows
    assert attn.v_proj.bias.data_ptr() == attn.qkv_proj.bias[v_start:].data_ptr()
    assert not list(attn.qkv_proj.parameters())  # the fused linear holds plain tensors: nothing stored twice


def test_to_rebuilds_the_fused_weights():
    """.to() converts the parameters; the fused weights are rebuilt from them, not left behind."""
    fused = random_target("llama", seed=2, runtime=False)
    double = fused.to(torch.float64)
    attn = double.model.layers[0].self_attn
    assert double.fused and attn.qkv_proj.weight.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()
    ref = random_target("llama", seed=2, fused=False, runtime=False).to(torch.float64)
    torch.testing.assert_close(logits(double, [3, 4], [7]), logits(ref, [3, 4], [7]))
