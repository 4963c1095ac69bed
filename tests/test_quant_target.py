"""A target on its GGUF file's own blocks (ddtree/runtime/cpu/quant_target.py, quant="gguf"): the same model as the float
target, lossless methods on it, and the refusals."""
import random

import numpy as np
import pytest
import torch

from conftest import run
from ddtree.base.config import ConfigError
from ddtree.models.drafter import untrained_drafter
from ddtree.models.gguf_export import permute_rope_rows, write_gguf
from ddtree.runtime.cpu.qlinear import QLinear, QWeight, round_po2_q8
from ddtree.runtime.cpu import quant_target
from ddtree.runtime.cpu.quant_target import dequantized_state, llama_row_order, quantize_target, streams_past_cache
from ddtree.runtime.cpu.runtime import attach, cpu_target
from ddtree.bench.testing import random_target
from test_gguf_export import template


def test_llama_row_order_undoes_the_gguf_permutation():
    w = np.arange(8 * 2 * 6, dtype=np.float32).reshape(2 * 8, 6)  # 2 heads of dim 8
    permuted = torch.from_numpy(permute_rope_rows(w, 2))
    assert torch.equal(permuted[llama_row_order(16, 2)], torch.from_numpy(w))


def quantizable_target(arch: str, seed: int = 3, runtime: bool = True):
    """A random target whose matrices are already on the Q4_1 (layers) / Q8_0 (embedding, head) grids, so the
    float model and its quantized GGUF are the same model (in the CPU runtime unless runtime=False)."""
    target = random_target(arch, seed=seed, init_scale=0.25, fused=False, runtime=False)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() == 2:
                kind = "Q4_1" if name.startswith("model.layers.") else "Q8_0"
                p.copy_(QWeight.quantize(p, kind).dequantize())
    return attach(target.fuse(), None)[0] if runtime else target.fuse()


def rounded_drafter(target, seed: int):
    """An untrained drafter with a reduced vocabulary, its matrices on power-of-two 8-bit grids (as `train
    quantize` rounds one), so the runtime streams them as 8-bit blocks."""
    drafter = untrained_drafter(target, 2, 8, seed=seed, draft_vocab=torch.arange(0, 96, 2))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.copy_(round_po2_q8(p))
    return drafter


def quantized(arch: str, tmp_path, seed: int = 3, int8: bool = False):
    """The target on its GGUF's blocks (quant='gguf'; with int8, quant='gguf-int8')."""
    path = write_gguf(quantizable_target(arch, seed), tmp_path / f"{arch}.gguf", template(tmp_path / "t.gguf"),
                      quant="Q4_1")
    return cpu_target(quantizable_target(arch, seed, runtime=False), quant_gguf=path, int8=int8)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # llama: q/k rows permuted in the file; qwen3: q/k norms
def test_quantized_target_is_the_float_model(arch, tmp_path):
    q, ref = quantized(arch, tmp_path), quantizable_target(arch)
    assert q.quant == "gguf Q4_1/Q8_0" and isinstance(q.model.lm_head, QLinear) and q.row_logits
    attn = q.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QLinear) and isinstance(attn.o_proj, QLinear)
    from test_fused import logits

    for extra in ([5], [5, 17, 40, 2, 9]):
        torch.testing.assert_close(logits(q, [1, 2, 3, 4], extra), logits(ref, [1, 2, 3, 4], extra),
                                   rtol=1e-4, atol=1e-4)
    state, float_state = dequantized_state(q), ref.model.state_dict()
    assert state.keys() == float_state.keys()
    assert all(torch.equal(state[k], float_state[k]) for k in state)


@pytest.mark.parametrize("int8", [False, True], ids=["float-activations", "int8-activations"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dflash_and_ddtree_on_a_quantized_target_equal_its_ar(arch, int8, tmp_path):
    """Every row of a pass is computed alone on the quantized kernels (float or int8 activations), so dflash and
    ddtree are exactly the mode's own ar; with float activations that is also the float target's ar."""
    target, drafter = attach(quantized(arch, tmp_path, seed=11, int8=int8), rounded_drafter(
        quantizable_target(arch, seed=11), seed=12))
    assert target.stack is not None and target.quant == "gguf Q4_1/Q8_0" + (" int8" if int8 else "")
    # the drafter's copies take the target's activations: 4-bit blocks with int8 activations in the int8 mode, its
    # exact 8-bit blocks otherwise (shapes the tree only)
    assert drafter.int8 == int8 and drafter.head.compact.int8 == int8
    assert drafter.head.compact.kind == ("Q4_1" if int8 else "Q8_0")
    float_target = quantizable_target(arch, seed=11)
    float_drafter = rounded_drafter(float_target, seed=12)
    rng = random.Random(5)
    for _ in range(4):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 30))]
        ar, _ = run(target, drafter, prompt, "ar", max_new_tokens=24)
        if not int8:
            assert ar == run(float_target, float_drafter, prompt, "ar", max_new_tokens=24)[0]
        for method, budget in (("dflash", None), ("ddtree", 4), ("ddtree", 32)):
            tokens, _ = run(target, drafter, prompt, method, budget=budget, max_new_tokens=24)
            assert tokens == ar, f"{method}:{budget} differs from ar on the quantized target"


def test_a_target_many_times_the_cache_streams_past_it(tmp_path, monkeypatch):
    """The int8 target's weights are prefetched non-temporally where they are >= STREAM_CACHE_MULTIPLE times the
    last-level cache (so they leave it to the drafter), kept otherwise; the drafter's never; the tokens are the same."""
    w = QWeight.quantize(torch.randn(64, 64), "Q4_1")
    size = w.qs.nbytes
    assert streams_past_cache([w, None, w], cache_bytes=size) and not streams_past_cache([w], cache_bytes=size)
    runs = {}
    for cache in (1 << 40, 1):
        monkeypatch.setattr(quant_target, "last_level_cache_bytes", lambda cache=cache: cache)
        target, drafter = attach(quantized("qwen3", tmp_path, seed=11, int8=True),
                                 rounded_drafter(quantizable_target("qwen3", seed=11), seed=12))
        flags = {q.stream for layer in target.model.model.layers for q in layer_qweights(layer)}
        assert flags == {cache == 1} and target.model.lm_head.weight.stream == (cache == 1)
        assert not drafter.head.compact.stream
        runs[cache] = [run(target, drafter, [3, 1, 4, 1, 5], method, budget=4, max_new_tokens=16)[0]
                       for method in ("ar", "ddtree")]
    assert runs[1] == runs[1 << 40] and runs[1][0] == runs[1][1]


def layer_qweights(layer) -> list[QWeight]:
    return [m.weight for m in layer.modules() if isinstance(m, QLinear)]


def test_int8_activations_are_llama_cpps_arithmetic_close_to_the_float_model(tmp_path):
    """quant='gguf-int8': every product of the stack and of the eager layers quantizes its activations per block
    (kernels/int8_linear.cpp): logits within a few % of the float model's largest (the same greedy tokens here),
    and the stack matches the eager layers on the same kernels within float32 rounding, one row or several."""
    from conftest import reference_arithmetic
    from test_fused import logits

    q, f = quantized("qwen3", tmp_path, int8=True), quantizable_target("qwen3")
    attn = q.model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.int8 and q.model.lm_head.weight.int8 and q.describe()["quant"].endswith("int8")
    for extra in ([5], [5, 17, 40, 2, 9]):
        a, b = logits(q, [1, 2, 3, 4], extra), logits(f, [1, 2, 3, 4], extra)
        assert not torch.equal(a, b) and torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, rtol=0, atol=0.05 * b.abs().max().item())
        with reference_arithmetic(q):
            torch.testing.assert_close(logits(q, [1, 2, 3, 4], extra), a, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("int8", [False, True], ids=["float-activations", "int8-activations"])
def test_verify_reads_the_quantized_heads_rows_lazily_where_that_is_cheaper(int8, tmp_path):
    """A head with float activations (compute-bound at several rows) reads a walk's rows lazily from 2 nodes; one
    with int8 activations, whose extra rows cost little next to streaming the weight once, reads all rows at once
    up to INT8_HEAD_ALL_ROWS. Either way a row's logits are the same bits (a row never depends on the others)."""
    from ddtree.models.attention import Visibility
    from ddtree.runtime.cpu.runtime import INT8_HEAD_ALL_ROWS
    from ddtree.engine.tree import ancestor_matrix, chain_parents

    target = quantized("llama", tmp_path, int8=int8)
    limit = INT8_HEAD_ALL_ROWS[bool(target.kernel.int8_vnni)] if int8 else 1
    assert [target.lazy_logits(n) for n in (1, 2, limit, limit + 1)] == [False, limit == 1, False, True]
    tokens = torch.tensor([5, 17, 40, 2, 9, 33])
    cache = target.new_cache(16)
    target(tokens[:2], torch.arange(2), cache, Visibility.causal(0, 2, tokens.device))
    cache.commit(2)
    parents, depths = chain_parents(4)
    vis = Visibility(2, torch.from_numpy(ancestor_matrix(parents, depths)))
    lazy = target(tokens[2:], torch.arange(2, 6), cache, vis, row_logits=True).logits
    full = target(tokens[2:], torch.arange(2, 6), cache, vis).logits
    assert torch.equal(torch.cat([lazy[i:i + 1] for i in range(4)]), full)


def test_load_names_the_quant_modes(tmp_path):
    import ddtree

    with pytest.raises(ConfigError, match="unknown quant 'int4'.*'gguf-int8'"):
        ddtree.load(quant="int4")
    with pytest.raises(ConfigError, match="cpu_kernel='off'"):
        ddtree.load(quant="gguf-int8", cpu_kernel="off")


def test_a_gguf_that_is_not_the_float_model_is_refused(tmp_path):
    path = write_gguf(quantizable_target("llama", seed=3), tmp_path / "a.gguf", template(tmp_path / "t.gguf"),
                      quant="Q4_1")
    with pytest.raises(ConfigError, match="does not dequantize to the float weights"):
        quantize_target(quantizable_target("llama", seed=4, runtime=False), path)


def test_a_quantized_target_stays_put(tmp_path):
    q = quantized("llama", tmp_path)
    with pytest.raises(ConfigError, match="without quant to move"):
        q.model.to(torch.float64)
    with pytest.raises(ConfigError, match="no float layout"):
        q.model.fuse(False)


def test_load_refuses_quant_where_it_cannot_run(tmp_path):
    import ddtree

    with pytest.raises(ConfigError, match="unknown quant"):
        ddtree.load(quant="q3")
    with pytest.raises(ConfigError, match="needs a GGUF target"):
        ddtree.load(target=str(tmp_path), quant="gguf")
    with pytest.raises(ConfigError, match="float32 activations"):
        ddtree.load(quant="gguf", dtype="bfloat16")


@pytest.mark.real_model
def test_embedded_default_quantized_decodes_as_the_float_target():
    """SmolLM2's own Q4_1 / Q8_0 file: its blocks equal the float weights (checked at load), and ar and ddtree
    on it give the float target's greedy tokens (the checker allows rounding near-ties, none expected here)."""
    import ddtree

    q, f = ddtree.load(quant="gguf"), ddtree.load(dtype="float32")
    assert q.target.quant == "gguf Q4_1/Q8_0"
    ids = q.encode("Write a Python function that returns the n-th Fibonacci number.")
    reference = f.generate(ids, method="ar", max_new_tokens=48).token_ids
    for method, budget in (("ar", None), ("ddtree", 16)):
        tokens = q.generate(ids, method=method, budget=budget, max_new_tokens=48).token_ids
        verdict = q.check(ids, reference, tokens)
        assert verdict.kind in ("identical", "tie_flip"), (method, verdict)


def test_hf_peer_runs_the_dequantized_weights(tmp_path):
    """The `hf` method on a quantized target loads the exact float weights (dequantized) into transformers."""
    from ddtree.bench.hf_baseline import to_hf_model
    from test_fused import logits

    q = quantized("llama", tmp_path)
    hf = to_hf_model(q)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        hf_logits = hf(ids).logits[0, -1:]
    torch.testing.assert_close(hf_logits, logits(q, [1, 2, 3, 4], [5]), rtol=1e-4, atol=1e-4)


def test_quantized_and_float_targets_keep_separate_verify_cost_curves(tmp_path):
    from ddtree.engine.cost_cache import cost_key

    q, f = quantized("llama", tmp_path), quantizable_target("llama")
    drafter = untrained_drafter(f, 1, 8)
    assert cost_key(q, drafter, 8, 64) != cost_key(f, drafter, 8, 64)
    assert cost_key(q, drafter, 8, 64)["quant"] == "gguf Q4_1/Q8_0" and "quant" not in cost_key(f, drafter, 8, 64)


def test_a_gguf_the_table_reader_refuses_goes_to_gguf_py(tmp_path, monkeypatch):
    """read_tensors takes little-endian v2 / v3 files; for any other (big-endian, v1), gguf-py's reader gives the
    same blocks."""
    target = quantizable_target("qwen3", runtime=False)
    path = write_gguf(quantizable_target("qwen3"), tmp_path / "m.gguf", template(tmp_path / "t.gguf"), quant="Q4_1")
    layers, head = quant_target.gguf_blocks(target, path)

    def refuse(p):
        raise ValueError("a big-endian file")

    monkeypatch.setattr(quant_target, "read_tensors", refuse)
    layers2, head2 = quant_target.gguf_blocks(target, path)
    pairs = [(a[k], b[k]) for a, b in zip(layers, layers2) for k in a] + [(head, head2)]
    assert len(pairs) > 1 and all(isinstance(a, QWeight) for a, _ in pairs)
    assert all(a.kind == b.kind and torch.equal(a.dequantize(), b.dequantize()) for a, b in pairs)
