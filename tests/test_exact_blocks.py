"""A float target that reads its narrow passes from the GGUF blocks its weights came from
(ddtree/runtime/cpu/exact_blocks.py): the same bits as the float weights, so the same model and the same tokens."""
import json
import random

import pytest
import torch

from conftest import run
from ddtree.base import cache
from ddtree.runtime.cpu import exact_blocks
from ddtree.models.attention import Visibility
from ddtree.base.cache import CACHE_MANIFEST
from ddtree.models.drafter import untrained_drafter
from ddtree.models.gguf_export import write_gguf
from ddtree.runtime.cpu.qlinear import QWeight, head_max_rows, kernel, layer_max_rows
from ddtree.runtime.cpu.runtime import CPUTarget, cpu_target
from test_gguf_export import template
from test_quant_target import quantizable_target

def gguf_of(target, tmp_path, name="t.gguf"):
    return write_gguf(target, tmp_path / name, template(tmp_path / "template.gguf"), quant="Q4_1")


def with_blocks(arch, tmp_path, seed=3):
    target = quantizable_target(arch, seed, runtime=False)
    return CPUTarget(target, blocks=exact_blocks._extract(target, gguf_of(quantizable_target(arch, seed), tmp_path)))


def loaded(path, conversion, seed=3, **kw):
    """What load() gives a float target converted from the GGUF `path` (cpu_target: the runtime, with the file's
    exact blocks where they are the target's weights)."""
    return cpu_target(quantizable_target("llama", seed, runtime=False), source_gguf=path, conversion=conversion, **kw)


def stack_pass(target, rows, past=7, seed=0):
    cfg = target.cfg
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(cfg.num_layers, cfg.num_kv_heads, 40, cfg.head_dim, generator=g)
    v = torch.randn(cfg.num_layers, cfg.num_kv_heads, 40, cfg.head_dim, generator=g)
    h = torch.randn(rows, cfg.hidden_size, generator=g)
    cos, sin = torch.randn(rows, cfg.head_dim, generator=g), torch.randn(rows, cfg.head_dim, generator=g)
    anc = torch.tril(torch.ones(rows, rows, dtype=torch.bool)) if rows > 1 else None
    return target.stack.forward(h, cos, sin, k, v, past, anc, [0])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("threads", [1, 2])
def test_exact_blocks_give_the_float_weights_bits(arch, threads, tmp_path):
    blocked, plain = with_blocks(arch, tmp_path), quantizable_target(arch)
    assert blocked.blocks.layers[0][0].kind == "Q4_1" and blocked.blocks.head.kind == "Q8_0"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 5, 6, head_max_rows(), head_max_rows() + 3):
            for a, b in zip(stack_pass(blocked, rows), stack_pass(plain, rows)):
                assert torch.equal(a, b), f"{rows} rows"
            h = torch.randn(rows, blocked.cfg.hidden_size)
            # the float head through the row kernel (one row on one thread otherwise takes torch's GEMV)
            with torch.inference_mode():
                assert torch.equal(blocked.logits(h), kernel().f32_linear(h, plain.model.lm_head.weight.detach()))
    finally:
        torch.set_num_threads(before)


def test_blocks_serve_narrow_passes_and_the_float_weights_wide_ones(tmp_path):
    """Blocks of OTHER weights attached on purpose: narrow passes change, wider ones do not."""
    plain = quantizable_target("llama", 3)
    foreign = exact_blocks._extract(quantizable_target("llama", 4), gguf_of(quantizable_target("llama", 4), tmp_path,
                                                                            "other.gguf"))
    target = CPUTarget(quantizable_target("llama", 3, runtime=False), blocks=foreign)
    narrow, wide = layer_max_rows(), layer_max_rows() + 1
    assert not torch.equal(stack_pass(target, narrow)[0], stack_pass(plain, narrow)[0])
    assert torch.equal(stack_pass(target, wide)[0], stack_pass(plain, wide)[0])
    with torch.inference_mode():
        for rows, changes in ((head_max_rows(), True), (head_max_rows() + 1, False)):
            h = torch.randn(rows, target.cfg.hidden_size)
            assert torch.equal(target.logits(h), plain.logits(h)) != changes, f"head, {rows} rows"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_methods_with_exact_blocks_decode_as_float_ar(arch, tmp_path):
    blocked, plain = with_blocks(arch, tmp_path, seed=11), quantizable_target(arch, seed=11)
    drafter = untrained_drafter(blocked, 2, 8, seed=12)
    plain_drafter = untrained_drafter(plain, 2, 8, seed=12)
    rng = random.Random(5)
    for _ in range(4):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 30))]
        ar, _ = run(plain, plain_drafter, prompt, "ar", max_new_tokens=24)
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 32)):
            tokens, _ = run(blocked, drafter, prompt, method, budget=budget, max_new_tokens=24)
            assert tokens == ar, f"{method}:{budget} with exact blocks differs from float ar"


def test_exact_blocks_get_their_own_verify_cost_curve(tmp_path):
    from ddtree.engine.cost_cache import cost_key

    blocked, plain = with_blocks("llama", tmp_path), quantizable_target("llama")
    drafter = untrained_drafter(plain, 1, 8)
    assert cost_key(blocked, drafter, 8, 64)["exact_blocks"] and "exact_blocks" not in cost_key(plain, drafter, 8, 64)


def test_a_weight_written_in_place_drops_the_blocks(tmp_path):
    blocked, plain = with_blocks("llama", tmp_path), quantizable_target("llama")
    with torch.no_grad():
        for t in (blocked, plain):
            t.model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
            t.model.lm_head.weight.mul_(0.5)
    cache_a, cache_b = blocked.new_cache(8), plain.new_cache(8)
    out = blocked(torch.tensor([3]), torch.tensor([0]), cache_a, Visibility.causal(0, 1, "cpu"))
    ref = plain(torch.tensor([3]), torch.tensor([0]), cache_b, Visibility.causal(0, 1, "cpu"))
    assert blocked.blocks is None and blocked.stack is not None
    assert torch.equal(out.logits, ref.logits)


def fake_conversion(tmp_path, digest="abc"):
    conversion = tmp_path / "conv-123"
    conversion.mkdir(exist_ok=True)
    (conversion / CACHE_MANIFEST).write_text(json.dumps({"files": {"model.safetensors": digest}}))
    return conversion


def test_attach_checks_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    path, conversion = gguf_of(quantizable_target("llama"), tmp_path), fake_conversion(tmp_path)
    first = loaded(path, conversion)
    assert first.blocks is not None
    assert exact_blocks.cache_file(exact_blocks.cache_key(conversion)).is_file()
    monkeypatch.setattr(exact_blocks, "gguf_blocks", lambda *a: pytest.fail("read the GGUF again"))
    second = loaded(path, conversion)
    assert second.blocks is not None
    for a, b in zip(first.blocks.layers + [(first.blocks.head,)], second.blocks.layers + [(second.blocks.head,)]):
        for qa, qb in zip(a, b):
            assert isinstance(qb, QWeight) and qa.kind == qb.kind and torch.equal(qa.qs, qb.qs)
            assert (qa.d is None and qb.d is None) if qa.kind == "Q4_1" else torch.equal(qa.d, qb.d)
    # another conversion of the file (its weights' checksum changed): checked again, not trusted
    monkeypatch.undo()
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    assert loaded(path, fake_conversion(tmp_path, digest="def")).blocks is not None


def test_a_gguf_of_other_weights_gives_no_blocks_and_is_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    path, conversion = gguf_of(quantizable_target("llama", 4), tmp_path), fake_conversion(tmp_path)
    assert loaded(path, conversion).blocks is None
    monkeypatch.setattr(exact_blocks, "gguf_blocks", lambda *a: pytest.fail("read the GGUF again"))
    assert loaded(path, conversion).blocks is None


def same_blocks(a, b) -> bool:
    pairs = zip(a.layers + [(a.head,)], b.layers + [(b.head,)])
    return all(torch.equal(qa.qs, qb.qs) and (qa.d is None or torch.equal(qa.d, qb.d))
               for la, lb in pairs for qa, qb in zip(la, lb))


@pytest.mark.parametrize("damage", ["same size", "truncated"])
def test_damaged_cached_blocks_are_checked_again(tmp_path, monkeypatch, capsys, damage):
    """A cached blocks file whose bytes changed (at the same size, or cut short) is never read as the model's
    weights: it is noticed, the GGUF's blocks are checked again, and the cache is rewritten."""
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    path, conversion = gguf_of(quantizable_target("llama"), tmp_path), fake_conversion(tmp_path)
    first = loaded(path, conversion)
    assert first.blocks is not None
    file = exact_blocks.cache_file(exact_blocks.cache_key(conversion))
    data = bytearray(file.read_bytes())
    if damage == "same size":
        data[-64:] = bytes(255 - b for b in data[-64:])  # the last tensor's bytes: a header that still parses
    else:
        data = data[: len(data) // 2]
    file.write_bytes(bytes(data))
    capsys.readouterr()
    second = loaded(path, conversion)
    assert same_blocks(first.blocks, second.blocks)
    assert "damaged or foreign" in capsys.readouterr().err
    assert not cache.verify(file.parent) and file.read_bytes() != bytes(data)  # rewritten


def test_a_full_disk_while_caching_the_blocks_is_a_notice(tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own error type: a notice naming it, the blocks still used."""
    from safetensors import SafetensorError
    import safetensors.torch

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    target = loaded(gguf_of(quantizable_target("llama"), tmp_path), fake_conversion(tmp_path))
    err = capsys.readouterr().err
    assert "the disk is full" in err and "DDTREE_CACHE" in err and target.blocks is not None


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_blocks_can_be_turned_off_by_any_false_value(tmp_path, monkeypatch, value):
    from ddtree.base.options import LoadOptions

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DDTREE_GGUF_BLOCKS", value)  # read by load() (options.py), passed down as gguf_blocks
    assert loaded(gguf_of(quantizable_target("llama"), tmp_path), fake_conversion(tmp_path),
                  gguf_blocks=LoadOptions.resolve().gguf_blocks).blocks is None


def test_blocks_can_be_turned_off(tmp_path, monkeypatch):
    """gguf_blocks=False (load's argument) turns them off; the argument beats the environment either way."""
    from ddtree.base.options import LoadOptions

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    path, conversion = gguf_of(quantizable_target("llama"), tmp_path), fake_conversion(tmp_path)
    assert loaded(path, conversion, gguf_blocks=False).blocks is None
    monkeypatch.setenv("DDTREE_GGUF_BLOCKS", "1")
    assert loaded(path, conversion, gguf_blocks=LoadOptions.resolve(gguf_blocks=False).gguf_blocks).blocks is None
    monkeypatch.setenv("DDTREE_GGUF_BLOCKS", "0")
    assert loaded(path, conversion, gguf_blocks=LoadOptions.resolve(gguf_blocks=True).gguf_blocks).blocks is not None
    assert loaded(path, conversion).blocks is not None


@pytest.mark.real_model
def test_embedded_default_reads_its_exact_blocks():
    """ddtree.load() gives SmolLM2 its GGUF's Q4_1 / Q8_0 blocks; greedy tokens equal the float weights' alone
    (gguf_blocks=False) for every method (the checker allows rounding near-ties, none expected)."""
    import ddtree

    pair = ddtree.load(dtype="float32")
    assert pair.target.blocks is not None and pair.target.blocks.head.kind == "Q8_0"
    plain = ddtree.load(dtype="float32", gguf_blocks=False)
    assert plain.target.blocks is None
    ids = pair.encode("Write a Python function that returns the n-th Fibonacci number.")
    reference = plain.generate(ids, method="ar", max_new_tokens=48).token_ids
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 8)):
        tokens = pair.generate(ids, method=method, budget=budget, max_new_tokens=48).token_ids
        verdict = pair.check(ids, reference, tokens)
        assert verdict.kind in ("identical", "tie_flip"), (method, verdict)


def test_a_target_without_the_cpu_stack_gets_no_blocks(tmp_path, monkeypatch):
    """The generic transformers backend (no C++ stack, no `stack` attribute) and a float target without a stack."""
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    path, conversion = gguf_of(quantizable_target("llama"), tmp_path), fake_conversion(tmp_path)

    class GenericTarget:  # as ddtree.models.hf_target.HFTarget presents itself (protocol.Target)
        dtype, backend, quant = torch.float32, "hf:sdpa", None

    generic = GenericTarget()
    assert cpu_target(generic, source_gguf=path, conversion=conversion) is generic
    assert loaded(path, conversion, cpu_kernel="off").blocks is None  # torch's matmuls: no stack
