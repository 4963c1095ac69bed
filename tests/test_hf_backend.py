"""The generic Hugging Face target backend: tiny seeded random models of each architecture, built from configs
and saved with save_pretrained, must give exactly HF generate()'s greedy tokens (fp32) under ar, dflash and
ddtree, through sliding windows shorter than the context and non-prefix accepted paths."""
import random
import warnings

import pytest
import torch

import ddtree
from conftest import plant_oracle, run
from ddtree.base.config import ConfigError
from ddtree.models.drafter import untrained_drafter
from ddtree.models.loading import load_target

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, tie_word_embeddings=False)
ARCHS = {
    "llama": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    # sliding window + attention sinks + MoE; a window of 6 is far shorter than prompt + output (and than a
    # depth-7 tree path), so both the cache trimming and the in-tree window are exercised
    "gpt_oss": dict(sliding_window=6, num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                         rope_theta=150000.0, beta_fast=32.0, beta_slow=1.0, truncate=False)),
    # alternating sliding (window 5) / full layers, attention and final-logit soft-capping, eager attention
    "gemma2": dict(sliding_window=5, attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
                   query_pre_attn_scalar=16),
    # every layer sliding (window 7), no layer_types: one mask for all layers, SDPA
    "phi3": dict(sliding_window=7),
}
BLOCK = 8


def save_tiny(arch: str, directory, seed: int = 0, **overrides):
    """A seeded random model of `arch` saved as a Hugging Face directory; weights scaled up from HF's tiny init
    so next-token distributions are peaked (greedy paths then do not hinge on rounding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**SMALL, **ARCHS.get(arch, {}), **overrides})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name or "sinks" in name else 0.2))
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return {arch: save_tiny(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHS}


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def count_moved_commits(target) -> dict:
    """Count commits whose accepted path is not a prefix of the tree (KV rows had to be moved)."""
    seen = {"moved": 0}
    make = target.new_cache

    def new_cache(capacity):
        cache = make(capacity)
        commit = cache.commit

        def counted(n, rows=None):
            seen["moved"] += rows is not None
            commit(n, rows)
        cache.commit = counted
        return cache
    target.new_cache = new_cache
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_matches_hf_generate(hf_dirs, arch):
    target = load_target(hf_dirs[arch], torch.float32, "cpu", backend="hf")
    assert target.backend.startswith("hf:") and target.cfg.arch == arch
    drafter = untrained_drafter(target, num_layers=1, block_size=BLOCK, seed=1)
    moved = count_moved_commits(target)
    rng = random.Random(arch)
    deep = 0
    for i in range(10):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 24))]
        max_new = (1, 5, 16, 32)[i % 4]
        reference = hf_greedy(target.hf, prompt, max_new)
        tokens, _ = run(target, None, prompt, "ar", max_new_tokens=max_new)
        assert tokens == reference, f"ar diverged from HF generate on prompt {i}"
        plant_oracle(drafter, prompt + reference + [0] * 300, seed=i)
        for method, budget in [("dflash", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]:
            tokens, stats = run(target, drafter, prompt, method, budget=budget, max_new_tokens=max_new)
            assert tokens == reference, f"{method}:{budget} diverged from HF generate on prompt {i}"
            assert stats.backend == target.backend
            deep = max(deep, max(stats.acceptance_lengths, default=1))
    assert moved["moved"] >= 5, "the oracle should make non-prefix accepted paths"
    assert deep > ARCHS[arch].get("sliding_window", 0), "accepted paths should reach past the window"


def test_self_check_catches_a_missing_window(hf_dirs, monkeypatch):
    """The load-time check compares our masked, cached pass with the model's own forward: a cache that
    forgets the sliding window must be refused, not run."""
    from ddtree.models import hf_cache

    monkeypatch.setattr(hf_cache, "kept_rows", lambda length, window: length)
    monkeypatch.setattr(hf_cache, "window_visible", lambda q, k, window, causal: hf_cache.torch.ones(
        len(q), len(k), dtype=torch.bool) if not causal else q[:, None] >= k[None, :])
    with pytest.raises(ConfigError, match="does not reproduce architecture 'gpt_oss'"):
        load_target(hf_dirs["gpt_oss"], torch.float32, "cpu", backend="hf")


def test_backend_choice_and_stats(hf_dirs):
    """auto: own code where it covers the architecture, hf elsewhere; the stats say which; both agree."""
    prompt = [3, 14, 15, 92, 65]
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untrained drafter
        for name, directory, backend in [("own", hf_dirs["llama"], "auto"), ("hf", hf_dirs["llama"], "hf"),
                                         ("moe", hf_dirs["qwen3_moe"], "auto")]:
            pair = ddtree.load(directory, device="cpu", dtype="float32", backend=backend)
            res = pair.generate(prompt, method="ddtree", budget=8, max_new_tokens=12)
            results[name] = res
    assert results["own"].stats.backend == "own"
    assert results["hf"].stats.backend == "hf:sdpa" and results["moe"].stats.backend == "hf:sdpa"
    assert results["own"].token_ids == results["hf"].token_ids


def test_refusals(hf_dirs, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3_next", **{**SMALL, "num_hidden_layers": 4}).save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match=r"qwen3_next.*linear-attention.*state per tree node"):
        ddtree.load(tmp_path, device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match=r"own-code backend cannot run.*gpt_oss.*backend 'hf'"):
        load_target(hf_dirs["gpt_oss"], torch.float32, "cpu", backend="own")
    with pytest.raises(ConfigError, match="unknown target backend"):
        load_target(hf_dirs["llama"], torch.float32, "cpu", backend="vllm")


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_tap_features_are_the_decoder_layer_outputs(hf_dirs, arch):
    """Hooked tap features = the model's own hidden_states[l + 1] (layers before the last, whose entry HF may
    give after the final norm), for a prefill and for a tree pass; on Llama they also equal the own code's."""
    from ddtree.models.attention import Visibility
    from ddtree.engine.tree import ancestor_matrix

    target = load_target(hf_dirs[arch], torch.float32, "cpu", backend="hf")
    ids = torch.tensor([5, 17, 3, 42, 8, 8, 61, 2, 30, 11, 9, 70])
    cache = target.new_cache(32)
    out = target(ids, torch.arange(12), cache, Visibility.causal(0, 12, "cpu"), tap_layers=(0,))
    own = target.hf(input_ids=ids[None], output_hidden_states=True)
    torch.testing.assert_close(out.taps, own.hidden_states[1][0])
    torch.testing.assert_close(out.logits, own.logits[0])
    # a tree over the last 4 tokens: root 8 -> {2 -> 30, 61}; node i must see the path to it only
    cache.reset()
    target(ids[:8], torch.arange(8), cache, Visibility.causal(0, 8, "cpu"))
    cache.commit(8)
    parents, depths = [-1, 0, 1, 0], [0, 1, 2, 1]
    import numpy as np
    anc = torch.from_numpy(ancestor_matrix(np.array(parents), np.array(depths)))
    tree = torch.tensor([8, 2, 30, 61])
    out = target(tree, 8 + torch.tensor(depths), cache, Visibility(8, anc), tap_layers=(0,))
    path = target.hf(input_ids=torch.cat([ids[:8], tree[:3]])[None], output_hidden_states=True)
    torch.testing.assert_close(out.taps[:3], path.hidden_states[1][0, 8:])
    torch.testing.assert_close(out.logits[:3], path.logits[0, 8:])
    branch = target.hf(input_ids=torch.cat([ids[:8], tree[:1], tree[3:]])[None]).logits[0, -1]
    torch.testing.assert_close(out.logits[3], branch)
    if arch == "llama":
        own_target = load_target(hf_dirs[arch], torch.float32, "cpu", backend="own")
        ref = own_target(ids, torch.arange(12), own_target.new_cache(12), Visibility.causal(0, 12, "cpu"),
                         tap_layers=(0,))
        torch.testing.assert_close(target(ids, torch.arange(12), target.new_cache(12),
                                          Visibility.causal(0, 12, "cpu"), tap_layers=(0,)).taps, ref.taps)


def test_attention_layout_reads_one_kwargs_dict_for_all_layers(monkeypatch):
    """Some transformers 5.x releases (5.17 on the GPU box) return one kwargs dict instead of one per layer;
    a full-attention layer has no window whatever the dict carries."""
    import transformers.cache_utils as cu
    from transformers import LlamaConfig

    from ddtree.models.hf_target import attention_layout

    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      vocab_size=64)
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs",
                        lambda c: (["full_attention"] * 3, {"sliding_window": None, "chunk": 1}))
    assert attention_layout(cfg) == (["full_attention"] * 3, [None] * 3)
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs",
                        lambda c: (["sliding_attention", "full_attention", "sliding_attention"], {"sliding_window": 5}))
    assert attention_layout(cfg) == (["sliding_attention", "full_attention", "sliding_attention"], [5, None, 5])


@pytest.mark.parametrize("arch", ["llama"])
def test_the_hf_backend_passes_transformers_no_deprecated_argument(hf_dirs, arch):
    """transformers 5.x deprecates forward(past_key_values=) for removal (a FutureWarning on every pass): the
    backend passes its cache under the name the installed transformers takes."""
    target = load_target(hf_dirs[arch], torch.float32, "cpu", backend="hf")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        tokens, _ = run(target, None, [1, 2, 3], "ar", max_new_tokens=4)
    assert len(tokens) == 4
