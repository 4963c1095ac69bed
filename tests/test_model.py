"""The target model: parity with Hugging Face, KV-cache consistency, tree-masked passes."""
import numpy as np
import pytest
import torch

from ddtree.models.attention import Visibility
from ddtree.bench.testing import random_target
from ddtree.engine.tree import ancestor_matrix


def full_logits(target, ids):
    cache = target.new_cache(len(ids))
    return target(torch.tensor(ids), torch.arange(len(ids)), cache, Visibility.causal(0, len(ids), "cpu")).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_matches_huggingface(arch):
    transformers = pytest.importorskip("transformers")
    target = random_target(arch, seed=1)
    cfg = {k: v for k, v in target.cfg.to_hf().items() if k != "model_type"}
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(arch, **cfg)).eval()
    result = hf.load_state_dict(target.model.state_dict(), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    if target.cfg.tie_word_embeddings:
        hf.tie_weights()
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(target, ids), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_incremental_decoding_matches_full_pass():
    target = random_target("qwen3", seed=2)
    ids = list(range(5, 30))
    full = full_logits(target, ids)
    cache = target.new_cache(len(ids))
    out = target(torch.tensor(ids[:10]), torch.arange(10), cache, Visibility.causal(0, 10, "cpu"))
    cache.commit(10)
    steps = [out.logits[-1]]
    for i in range(10, len(ids)):
        out = target(torch.tensor([ids[i]]), torch.tensor([i]), cache, Visibility(cache.length, None))
        cache.commit(1)
        steps.append(out.logits[0])
    torch.testing.assert_close(torch.stack(steps), full[9:], rtol=1e-4, atol=1e-4)


def test_tree_pass_equals_each_root_path():
    """One tree-masked pass gives, at every node, the logits of decoding that node's root path alone;
    committing a non-prefix path leaves the cache as if that path had been decoded plainly."""
    target = random_target("llama", seed=3)
    prompt = list(range(10, 22))
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 5])
    depths = np.array([0, 1, 1, 2, 2, 2, 3, 3])
    tokens = [7, 11, 12, 13, 14, 15, 16, 17]
    cache = target.new_cache(64)
    target(torch.tensor(prompt), torch.arange(12), cache, Visibility.causal(0, 12, "cpu"))
    cache.commit(12)
    vis = Visibility(12, torch.from_numpy(ancestor_matrix(parents, depths)))
    out = target(torch.tensor(tokens), torch.from_numpy(depths) + 12, cache, vis)
    for node in range(len(tokens)):
        path, j = [], node
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        ref = full_logits(target, prompt + path[::-1])[-1]
        torch.testing.assert_close(out.logits[node], ref, rtol=1e-4, atol=1e-4)
    # commit the path 0 -> 2 -> 5 -> 7, then decode one more token plainly
    cache.commit(4, torch.tensor([0, 2, 5, 7]))
    nxt = target(torch.tensor([3]), torch.tensor([16]), cache, Visibility(16, None)).logits[0]
    ref = full_logits(target, prompt + [7, 12, 15, 17, 3])[-1]
    torch.testing.assert_close(nxt, ref, rtol=1e-4, atol=1e-4)


def test_tap_features_are_layer_outputs():
    target = random_target("qwen3", seed=4)
    ids = torch.arange(1, 9)
    cache = target.new_cache(8)
    out = target(ids, torch.arange(8), cache, Visibility.causal(0, 8, "cpu"), tap_layers=(4, 1))
    h = target.cfg.hidden_size
    assert out.taps.shape == (8, 2 * h)
    cache2 = target.new_cache(8)
    out1 = target(ids, torch.arange(8), cache2, Visibility.causal(0, 8, "cpu"), tap_layers=(1,))
    torch.testing.assert_close(out.taps[:, h:], out1.taps)  # order follows tap_layers, not layer order


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ar_equals_huggingface_generate(arch):
    """Plain decoding through our engine gives HF generate()'s greedy tokens (an independent reference)."""
    from ddtree.api import Pair
    from ddtree.bench.hf_baseline import hf_generate, to_hf_model

    target = random_target(arch, seed=5, init_scale=0.25)
    hf = to_hf_model(target)
    for prompt in ([1, 2, 3], list(range(7, 30))):
        ours = Pair(target, None, None).generate(prompt, method="ar", max_new_tokens=24).token_ids
        theirs, _ = hf_generate(hf, prompt, 24)
        assert ours == theirs


def test_rotary_table_rows_equal_the_direct_computation():
    """On a CPU, RoPE cos/sin come from a table grown on demand: every row must equal the direct computation for
    any positions (a tree's repeated ones included), past the table's first size, in each dtype, and after the
    inverse frequencies are replaced (.to() of the model)."""
    from ddtree.models.layers import Rotary

    target = random_target("qwen3", seed=0)
    rotary = Rotary(target.cfg)
    for positions in (torch.tensor([0]), torch.arange(5, 9), torch.tensor([7, 8, 8, 9, 9, 9]),
                      torch.arange(Rotary.TABLE_MIN - 2, Rotary.TABLE_MIN + 3), torch.tensor([5000, 3])):
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = rotary(positions, dtype)
            ref_cos, ref_sin = rotary._compute(positions, dtype)
            assert cos.dtype == dtype and torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    positions = torch.arange(3, 6)
    rotary.inv_freq = rotary.inv_freq * 0.5  # new values in a new tensor: the table must not be reused
    assert torch.equal(rotary(positions, torch.float32)[0], rotary._compute(positions, torch.float32)[0])
    with torch.no_grad():
        rotary.inv_freq.mul_(3.0)  # and new values written in place
    assert torch.equal(rotary(positions, torch.float32)[0], rotary._compute(positions, torch.float32)[0])
