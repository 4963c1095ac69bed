"""The CPU kernel (ddtree/runtime/cpu/qlinear.py, kernels/qlinear.cpp): GGUF blocks dequantized exactly, products against a
dequantize-then-float reference, row results independent of the batch, the float32 / bf16 / packed / 8-bit paths,
the AVX-512 build against the AVX2 one, and the compiled library in the cache. The first test builds the kernel."""
import random
import re

import gguf
import pytest
import torch

from ddtree.base.config import ConfigError
from ddtree.runtime.cpu.qlinear import KERNEL_MAX_ROWS, QWeight
from ddtree.bench.testing import random_target

KINDS = ["Q4_1", "Q8_0"]


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_exactly_as_gguf_py(kind):
    w = torch.randn(37, 192, generator=torch.Generator().manual_seed(0))
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    blocks = gguf.quants.quantize(w.numpy(), qtype)
    q = QWeight.from_blocks(kind, blocks, (37, 192))
    assert torch.equal(q.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    error = (q.dequantize() - w).abs().max()
    assert 0 < error < (0.3 if kind == "Q4_1" else 0.03)  # half a quantization step of N(0, 1) blocks, at most


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 17, 64, KERNEL_MAX_ROWS + 1])
def test_kernel_matches_dequantize_then_float(kind, rows):
    gen = torch.Generator().manual_seed(rows)
    q = QWeight.quantize(torch.randn(203, 576, generator=gen), kind)  # 203: a tail of N % 4 outputs
    x = torch.randn(rows, 576, generator=gen)
    ref = x.double() @ q.dequantize().double().T
    torch.testing.assert_close(q.matmul(x).double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_batch(kind):
    """The kernel's summation order is fixed per output: one row alone, inside 17 rows, or against a slice of
    the outputs gives the same bits (so a decoding step and a verify project a row identically)."""
    gen = torch.Generator().manual_seed(1)
    q = QWeight.quantize(torch.randn(203, 640, generator=gen), kind)
    x = torch.randn(17, 640, generator=gen)
    together = q.matmul(x)
    assert torch.equal(together, torch.cat([q.matmul(x[i:i + 1]) for i in range(17)]))
    for rows in range(2, 17):  # the kernel's paths: one dequantizing pass (up to 5 rows, 12 on AVX-512), sweeps
        assert torch.equal(q.matmul(x[:rows]), together[:rows]), rows
    assert torch.equal(q.rows(5, 11).matmul(x), together[:, 5:11])
    torch.set_num_threads(2)
    try:
        assert torch.equal(q.matmul(x), together)  # another thread split
    finally:
        torch.set_num_threads(1)


def test_fused_rows_and_bad_input():
    gen = torch.Generator().manual_seed(2)
    a, b = (QWeight.quantize(torch.randn(n, 128, generator=gen), "Q4_1") for n in (8, 12))
    fused = QWeight.cat([a, b])
    x = torch.randn(3, 128, generator=gen)
    assert torch.equal(fused.matmul(x), torch.cat([a.matmul(x), b.matmul(x)], dim=1))
    with pytest.raises(ValueError, match="cannot fuse"):
        QWeight.cat([a, QWeight.quantize(torch.randn(8, 128, generator=gen), "Q8_0")])
    with pytest.raises(ConfigError, match="not supported"):
        QWeight.quantize(torch.randn(8, 128), "Q6_K")
    with pytest.raises(ConfigError, match="divisible by 64"):
        QWeight.quantize(torch.randn(8, 96), "Q4_1")
    with pytest.raises(RuntimeError, match="columns"):
        a.matmul(torch.randn(1, 64))


def test_float32_kernel_matches_torch_and_does_not_depend_on_the_batch():
    from ddtree.runtime.cpu.qlinear import kernel

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(203, 192, generator=gen)
    x = torch.randn(17, 192, generator=gen)
    y = kernel().f32_linear(x, w)
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)
    assert torch.equal(y, torch.cat([kernel().f32_linear(x[i:i + 1].contiguous(), w) for i in range(17)]))


def test_linear_takes_the_kernel_for_skinny_inference_products_only(monkeypatch):
    """The runtime's Linear: 2-64 float32 rows in inference go to the kernel; one row (without a transpose kept), a
    wide pass, a product that needs gradients, and a runtime without a kernel (cpu_kernel='off') take F.linear."""
    import ddtree.runtime.cpu.qlinear as qlinear
    from ddtree.runtime.cpu.runtime import Linear

    calls = []
    real = qlinear.kernel()
    kernel = type("K", (), {"f32_linear": staticmethod(lambda x, w: calls.append(x.shape[0]) or real.f32_linear(x, w))})
    w = torch.randn(32, 64)
    with torch.inference_mode():
        Linear(w, kernel)(torch.randn(5, 64))
        Linear(w, kernel)(torch.randn(1, 64))  # one row: torch (as fast)
        Linear(w, kernel)(torch.randn(65, 64))  # wide: torch's blocked GEMM
        Linear(w, None)(torch.randn(5, 64))  # no kernel
    assert calls == [5]
    wg = torch.randn(32, 64, requires_grad=True)
    out = Linear(wg, kernel)(torch.randn(5, 64))
    out.sum().backward()  # F.linear: differentiable
    assert calls == [5] and wg.grad is not None


def test_the_kernel_choice_is_a_load_argument_before_the_environment(monkeypatch):
    """load(cpu_kernel=...) names the build ('auto' the CPU's own) or turns it off; where it is not given,
    DDTREE_CPU_KERNEL=0 turns it off and DDTREE_CPU_ISA forces a build (read by load only: ddtree/base/options.py);
    bad names are refused with the choices."""
    import ddtree
    from ddtree.base.options import LoadOptions
    from ddtree.runtime.cpu import qlinear

    for name in ("DDTREE_CPU_KERNEL", "DDTREE_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    assert qlinear.resolve_cpu_kernel("avx2") == "avx2" and qlinear.resolve_cpu_kernel("off") == "off"
    assert qlinear.resolve_cpu_kernel("auto") in ("avx2", "avx512")
    monkeypatch.setenv("DDTREE_CPU_ISA", "avx2")
    assert qlinear.resolve_cpu_kernel(LoadOptions.resolve(cpu_kernel="auto").kernel) == "avx2"
    monkeypatch.setenv("DDTREE_CPU_KERNEL", "0")
    assert qlinear.resolve_cpu_kernel(LoadOptions.resolve().kernel) == "off"
    assert qlinear.resolve_cpu_kernel(LoadOptions.resolve(cpu_kernel="avx2").kernel) == "avx2"  # the argument wins
    with pytest.raises(ConfigError, match="unknown cpu_kernel 'sse4'.*auto, avx2, avx512, off"):
        qlinear.resolve_cpu_kernel("sse4")
    with pytest.raises(ConfigError, match="unknown cpu_kernel"):
        ddtree.load(cpu_kernel="fast")
    with pytest.raises(ConfigError, match="gguf_blocks must be True or False"):
        ddtree.load(gguf_blocks="no")


def test_bf16_kernel_equals_the_float32_kernel_on_the_widened_weights():
    """bf16_linear widens the weights in registers, exactly, and sums as f32_linear does: same bits, any rows."""
    from ddtree.runtime.cpu.qlinear import kernel

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 128, generator=gen).to(torch.bfloat16)
    for rows in (1, 2, 3, 7, 17):
        x = torch.randn(rows, 128, generator=gen)
        assert torch.equal(kernel().bf16_linear(x, w), kernel().f32_linear(x, w.float()))
    with pytest.raises(RuntimeError, match="bad bf16 weight"):
        kernel().bf16_linear(torch.randn(1, 96), torch.zeros(4, 96, dtype=torch.bfloat16))


def test_power_of_two_q8_blocks_are_exact_in_bf16_and_sum_as_bf16():
    """po2_q8: per block of 32, d = the smallest power of two with |w| <= 127 d. The rounded values are bfloat16
    values, the blocks of a rounded weight dequantize to it exactly (and to nothing else: a weight that is not such
    values has none), and q8_0_linear over them equals bf16_linear over the same values bit for bit, any rows."""
    from ddtree.runtime.cpu.qlinear import kernel, po2_q8, round_po2_q8

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, 128, generator=gen) * torch.logspace(-4, 1, 40).unsqueeze(1)  # scales far apart
    w[3, :32] = 0  # an all-zero block
    w[5, 40] = 127 * 2.0 ** -6  # a block whose largest value is exactly 127 d
    r = round_po2_q8(w)
    q = po2_q8(r)
    assert q is not None and torch.equal(q.dequantize(), r) and torch.equal(r.bfloat16().float(), r)
    assert q.d[5, 1] == 2.0 ** -6 and q.qs[5, 40] == 127 and torch.equal(q.qs[3, :32], torch.zeros(32, dtype=torch.int8))
    d = q.d.repeat_interleave(32, 1)
    assert (q.qs.abs() <= 127).all() and ((r - w).abs() <= d / 2).all()  # the nearest value on each block's grid
    amax = r.view(40, 4, 32).abs().amax(-1)
    assert (127 * q.d[amax > 0] / 2 < amax[amax > 0]).all()  # the smallest power of two that holds each block
    assert po2_q8(w) is None and po2_q8(r[:, :96]) is None  # not such values; K % 64 != 0
    assert round_po2_q8(r).equal(r)  # idempotent
    with pytest.raises(ValueError, match="K % 64 == 0"):
        round_po2_q8(torch.ones(4, 96))
    for rows in (1, 2, 3, 4, 5, 7, 9, 17):
        x = torch.randn(rows, 128, generator=gen)
        assert torch.equal(kernel().q8_0_linear(x, q.qs, q.d), kernel().bf16_linear(x, r.bfloat16()))


def test_packed_float32_kernel_equals_the_row_major_one():
    """f32p_linear reads pack_rows' tile-by-tile layout and sums as f32_linear does: same bits, any rows and
    threads (the prefetching differs with the rows, the arithmetic does not)."""
    from ddtree.runtime.cpu.qlinear import kernel, pack_rows

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 192, generator=gen)
    packed = pack_rows(w)
    assert packed.shape == (12, 3, 4, 64) and torch.equal(packed[1, 2, 3], w[4 * 1 + 3, 64 * 2:64 * 3])
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4, 5, 7, 17):
                x = torch.randn(rows, 192, generator=gen)
                assert torch.equal(kernel().f32p_linear(x, packed), kernel().f32_linear(x, w)), (threads, rows)
    finally:
        torch.set_num_threads(saved)
    with pytest.raises(ValueError, match="N % 4 == 0 and K % 64 == 0"):
        pack_rows(torch.zeros(6, 64))
    with pytest.raises(RuntimeError, match="bad packed weight"):
        kernel().f32p_linear(torch.randn(1, 64), torch.zeros(2, 4, 64))


AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.mark.skipif(not AVX512, reason="needs an x86 CPU with AVX-512 to run the avx512 build "
                    f"(torch reports {torch.backends.cpu.get_cpu_capability()!r})")
def test_the_avx512_build_gives_the_avx2_builds_bits(monkeypatch):
    """The AVX-512 build takes up to 12 rows in one pass, on other tiles; every output keeps its one chain of
    sums, so each product, and a whole target's logits through the decoder stack, are the AVX2 build's bits."""
    from ddtree.models.attention import Visibility
    from ddtree.runtime.cpu import qlinear
    from ddtree.runtime.cpu.runtime import CPUTarget

    avx2, avx512 = qlinear.build_kernel("avx2"), qlinear.build_kernel("avx512")
    assert (avx2.wide_pass_rows, avx512.wide_pass_rows, avx2.isa, avx512.isa) == (5, 12, "avx2", "avx512")
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(203, 640, generator=gen)
    for kind in KINDS:
        q = QWeight.quantize(w, kind)
        for rows in range(1, 18):
            x = torch.randn(rows, 640, generator=gen)
            if kind == "Q4_1":
                a, b = (k.q4_1_linear(x, q.qs) for k in (avx2, avx512))
            else:
                a, b = (k.q8_0_linear(x, q.qs, q.d) for k in (avx2, avx512))
            assert torch.equal(a, b), (kind, rows)
    w4 = w[:200]  # packed float32 needs N % 4 == 0
    for rows in range(1, 18):
        x = torch.randn(rows, 640, generator=gen)
        assert torch.equal(avx2.f32_linear(x, w), avx512.f32_linear(x, w)), rows
        assert torch.equal(avx2.bf16_linear(x, w.bfloat16()), avx512.bf16_linear(x, w.bfloat16())), rows
        packed = qlinear.pack_rows(w4)
        assert torch.equal(avx2.f32p_linear(x, packed), avx512.f32p_linear(x, packed)), rows

    def logits_with(build, head_dim):
        """A random target's stack built on `build`: a prompt, then a 9-node tree pass and a 1-row step. The head
        sizes take every path of the AVX-512 attention (two queries a vector): 64 columns at a time, 16, and 8
        (8 heads: the o projection reads 64-column blocks)."""
        monkeypatch.setattr(qlinear, "kernel", lambda choice="auto": build)
        reference = random_target("qwen3", seed=3, fused=False, runtime=False, head_dim=head_dim, num_heads=8)
        with torch.no_grad():  # bf16 values, as a checkpoint published in bf16: the stack streams bf16 copies
            for p in reference.parameters():
                p.copy_(p.bfloat16().float())
        target = CPUTarget(reference.fuse(True))  # the runtime takes qlinear.kernel(): `build`
        assert target.kernel is build and target.stack is not None
        cache = target.new_cache(64)
        ids = torch.randint(0, target.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
        target(ids[:20], torch.arange(20), cache, Visibility.causal(0, 20, "cpu"))
        cache.commit(20)
        anc = torch.tril(torch.ones(9, 9, dtype=torch.bool))
        tree = target(ids[20:29], torch.arange(20, 29), cache, Visibility(20, anc)).logits
        step = target(ids[20:21], torch.arange(20, 21), cache, Visibility(20, None)).logits
        return tree, step

    for head_dim in (24, 88):
        for a, b in zip(logits_with(avx2, head_dim), logits_with(avx512, head_dim)):
            assert torch.equal(a, b), head_dim


def test_a_failed_avx512_build_falls_back_to_the_avx2_build(monkeypatch):
    """Where torch reports AVX-512 but the AVX-512 build does not compile, the AVX2 build serves (with a
    warning) instead of the CPU losing its kernel; DDTREE_CPU_ISA names a build outright, and a bad name is refused."""
    from ddtree.runtime.cpu import qlinear

    calls = []

    def fake_build(isa="avx2"):
        calls.append(isa)
        if isa == "avx512":
            raise ConfigError("no -mavx512vl here")
        return f"build:{isa}"

    monkeypatch.setattr(qlinear, "build_kernel", fake_build)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("DDTREE_CPU_ISA", raising=False)
    monkeypatch.delenv("DDTREE_CPU_KERNEL", raising=False)
    qlinear.kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="AVX-512 build of the CPU kernel failed"):
            assert qlinear.kernel() == "build:avx2"
        assert calls == ["avx512", "avx2"]
    finally:
        qlinear.kernel.cache_clear()
    monkeypatch.undo()
    from ddtree.base.options import LoadOptions

    monkeypatch.setenv("DDTREE_CPU_ISA", "sse4")
    with pytest.raises(ConfigError, match="DDTREE_CPU_ISA='sse4' is not valid"):
        LoadOptions.resolve()
    monkeypatch.setenv("DDTREE_CPU_ISA", "AVX2")
    assert qlinear.resolve_cpu_kernel(LoadOptions.resolve().kernel) == "avx2"


# --- the compiled kernels in the cache (qlinear.compile_extension, on a tiny extension that builds in seconds) -
TINY = """#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(a) #a
#define STR(a) STR2(a)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&mod); }
"""


def tiny_build(tmp_path, monkeypatch):
    """compile_extension of TINY into a cache under tmp_path: (a function that builds or loads it, its folder)."""
    from ddtree.runtime.cpu import qlinear

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    build = lambda: qlinear.compile_extension("ddtree_tiny", [source], ["-O0"], "the tiny test extension")  # noqa: E731
    module = build()
    assert module.answer() == 42
    folders = [p for p in (tmp_path / "cache" / "kernels").iterdir() if p.is_dir()]
    assert len(folders) == 1
    return build, folders[0]


def library_of(folder):
    from ddtree.base import cache

    return folder / cache.read_manifest(folder)["library"]


def damage(library, data: bytes) -> None:
    """Give `library` other bytes as a new file: this process has the old one mapped, and writing into a mapped
    library (what a damaged cache does to a process that loads it) is a bus error."""
    library.unlink()
    library.write_bytes(data)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_build_lock_is_removed_not_waited_for(tmp_path, monkeypatch, capsys):
    """A process killed while building leaves its lock; the next build sees its owner gone, removes it and builds
    (a hang before: every later load waited forever, printing nothing)."""
    import socket
    import threading

    build, folder = tiny_build(tmp_path, monkeypatch)
    lock = folder.with_name(folder.name + ".lock")
    lock.write_text(f"{socket.gethostname()} {dead_pid()}\n")
    damage(library_of(folder), b"")  # and the library must be built again (so the lock is needed)
    result = []
    worker = threading.Thread(target=lambda: result.append(build()), daemon=True)
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive(), "compile_extension hangs on a stale lock"
    assert result[0].answer() == 42 and not lock.exists()
    assert "removing the stale lock" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["garbage", "empty"])
def test_a_damaged_library_is_rebuilt_and_never_loaded(tmp_path, monkeypatch, capsys, kind):
    """A damaged compiled library (a bus error or segfault when loaded) fails its checksum: it is built again,
    with a notice, and only the rebuilt one is imported."""
    from ddtree.base import cache

    build, folder = tiny_build(tmp_path, monkeypatch)
    library = library_of(folder)
    size = library.stat().st_size
    damage(library, b"" if kind == "empty" else bytes(random.Random(0).randrange(256) for _ in range(size)))
    loaded = []
    real_import = cache.import_library
    monkeypatch.setattr("ddtree.runtime.cpu.qlinear.import_library", lambda p, n: loaded.append(p) or real_import(p, n))
    capsys.readouterr()
    assert build().answer() == 42
    assert "damaged or incomplete" in capsys.readouterr().err
    assert not loaded  # the damaged file was not imported: the rebuilt module came from the build itself
    assert not cache.verify(folder, required=(library_of(folder).name,))


def test_a_complete_build_in_a_read_only_cache_is_used_as_it_is(tmp_path, monkeypatch):
    """A read-only cache (a container, a shared install) with a complete build: imported without a lock, a
    compiler or a write (before, the build lock could not be taken and torch's slower matmuls served)."""
    from ddtree.runtime.cpu import qlinear

    build, folder = tiny_build(tmp_path, monkeypatch)

    def no_lock(*args, **kwargs):
        raise ConfigError("the cache is read-only")

    monkeypatch.setattr(qlinear, "build_lock", no_lock)
    monkeypatch.setattr(qlinear, "replacing_dir", no_lock)
    assert build().answer() == 42


def test_bad_kernel_knobs_are_refused_and_false_turns_it_off(monkeypatch):
    """DDTREE_CPU_ISA=bogus is an error (before: a warning and torch's 2x slower matmuls); DDTREE_CPU_KERNEL
    takes any boolean spelling (before: only "0" turned it off)."""
    from ddtree.base.options import LoadOptions
    from ddtree.runtime.cpu import qlinear

    qlinear.cpu_kernel_available.cache_clear()
    try:
        monkeypatch.setenv("DDTREE_CPU_ISA", "bogus")
        with pytest.raises(ConfigError, match="DDTREE_CPU_ISA='bogus' is not valid: use one of auto, avx2, avx512"):
            LoadOptions.resolve()
        monkeypatch.delenv("DDTREE_CPU_ISA")
        for value in ("false", "OFF", "no", "0"):
            monkeypatch.setenv("DDTREE_CPU_KERNEL", value)
            assert qlinear.cpu_kernel_available(LoadOptions.resolve().kernel) is False
        monkeypatch.setenv("DDTREE_CPU_KERNEL", "maybe")
        with pytest.raises(ConfigError, match="DDTREE_CPU_KERNEL='maybe' is not a boolean"):
            LoadOptions.resolve()
    finally:
        qlinear.cpu_kernel_available.cache_clear()


def test_a_cold_build_says_so_and_keeps_saying_so(tmp_path, monkeypatch, capsys):
    """A build announces itself with how long it takes, then a notice every BUILD_NOTICE_EVERY seconds while the
    compiler runs (a cold first load was 137 s of silence); the damaged-build notice reads as a sentence."""
    from ddtree.runtime.cpu import qlinear

    monkeypatch.setattr(qlinear, "BUILD_NOTICE_EVERY", 0.05)
    build, folder = tiny_build(tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert "building the tiny test extension (once, ~1-2 min; cached in" in err
    assert re.search(r"still building the tiny test extension \(\d+ s so far\)", err)
    damage(library_of(folder), b"")
    assert build().answer() == 42
    err = capsys.readouterr().err
    assert "the tiny test extension, compiled in " in err and "compiled the" not in err


def test_the_build_key_covers_the_headers_beside_the_sources(tmp_path):
    """A header a source can include (`#include "x.h"` beside it) changes the build's key, as the source, the
    flags and the name do; a file of another kind beside them does not. Before, only the sources counted, and a
    header changed by an upgrade loaded the build of its old text."""
    from ddtree.runtime.cpu.qlinear import build_key

    source, header = tmp_path / "tiny.cpp", tmp_path / "answer.h"
    source.write_text('#include "answer.h"\n')
    header.write_text("#define ANSWER 42\n")
    key = build_key("tiny", [source], ["-O0"])
    assert len(key) == 12 and build_key("tiny", [source], ["-O0"]) == key
    (tmp_path / "notes.md").write_text("not compiled")
    assert build_key("tiny", [source], ["-O0"]) == key
    header.write_text("#define ANSWER 43\n")
    changed = build_key("tiny", [source], ["-O0"])
    assert changed != key
    assert len({changed, build_key("tiny", [source], ["-O1"]), build_key("other", [source], ["-O0"])}) == 3
    source.write_text('#include "answer.h"\n// edited\n')
    assert build_key("tiny", [source], ["-O0"]) != changed


def test_a_changed_header_beside_the_sources_is_a_new_build(tmp_path, monkeypatch):
    """The build's key covers the headers a source can include (`#include "x.h"` beside it), not only the sources:
    a header changed by an upgrade must not load the build of its old text."""
    from ddtree.runtime.cpu import qlinear

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    source, header = tmp_path / "tiny.cpp", tmp_path / "answer.h"
    source.write_text('#include "answer.h"\n' + TINY.replace("PyLong_FromLong(42)", "PyLong_FromLong(ANSWER)"))
    header.write_text("#define ANSWER 42\n")
    build = lambda: qlinear.compile_extension("ddtree_tiny", [source], ["-O0"], "the tiny test extension")  # noqa: E731
    first = build()
    assert first.answer() == 42 and build().ddtree_build == first.ddtree_build  # unchanged: loaded, not rebuilt
    header.write_text("#define ANSWER 43\n")
    second = build()
    assert second.ddtree_build != first.ddtree_build
    assert len([p for p in (tmp_path / "cache" / "kernels").iterdir() if p.is_dir()]) == 2
    assert qlinear._import_build(tmp_path / "cache" / "kernels" / second.ddtree_build).answer() == 43


def test_a_build_is_named_by_its_folder_whether_built_or_loaded(tmp_path, monkeypatch):
    """`ddtree_build` (the verify-cost curve's key) is the cache folder's name in the process that built the
    kernel and in every later one; the building process's `__file__` names a staging folder, so a key read from it
    stored the first process's curve where no later process looked."""
    from ddtree.runtime.cpu import qlinear

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    built = qlinear.compile_extension("ddtree_tiny", [source], ["-O0"], "the tiny test extension")
    (folder,) = [p for p in (tmp_path / "cache" / "kernels").iterdir() if p.is_dir()]
    assert built.ddtree_build == folder.name and not folder.name.startswith(".")
    assert qlinear._import_build(folder).ddtree_build == folder.name  # as a later process loads it


def test_tiles_taken_as_the_threads_go_give_the_same_bits():
    """The float kernels' tiles go to the threads a chunk at a time (parallel_chunks), each thread with its own
    dequantization buffer kept between calls: any thread count (more threads than cores too), passes of other widths
    in between, many tiles and a tail of N % 4 rows, every output the 1-thread bits."""
    from ddtree.runtime.cpu.qlinear import QWeight, kernel

    gen = torch.Generator().manual_seed(6)
    w = QWeight.quantize(torch.randn(4099, 128, generator=gen) * 0.05, "Q4_1")
    xs = {rows: torch.randn(rows, 128, generator=gen) for rows in (1, 3, 6, 9)}
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = {rows: kernel().q4_1_linear(x, w.qs) for rows, x in xs.items()}
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            for rows in (9, 1, 6, 3, 9, 1):
                assert torch.equal(kernel().q4_1_linear(xs[rows], w.qs), expected[rows]), (threads, rows)
    finally:
        torch.set_num_threads(saved)
