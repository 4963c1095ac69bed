"""The int8-activation kernel (kernels/int8_linear.cpp, ddtree.runtime.cpu.int8): its quantization and its products equal
the plain-torch reference bit for bit, a row's result does not depend on the other rows or the threads, and the
result is close to the float product."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ddtree.base.cache import cache_root
from ddtree.runtime.cpu import int8, qlinear
from ddtree.runtime.cpu.qlinear import QWeight, cpu_flags

# SmolLM2-135M's projections (N, K): qkv fused, o, gate/up fused, down; and odd N
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (67, 576), (1, 64), (5, 128)]
KINDS = ("Q4_1", "Q8_0")

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the kernel needs AVX2")


@pytest.fixture(scope="module")
def weights():
    """QWeights by (kind, N, K), quantized once by gguf-py from a seeded random float weight."""
    gen = torch.Generator().manual_seed(0)
    cache = {}

    def get(kind, n, k):
        if (kind, n, k) not in cache:
            cache[kind, n, k] = QWeight.quantize(torch.randn(n, k, generator=gen) * 0.05, kind)
        return cache[kind, n, k]
    return get


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows with mixed scales per block, a zero block and an outlier, as hidden states have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, k // 32, 1, generator=gen).mul(3).exp().repeat_interleave(
        32, 1).view(m, k)
    if k >= 64:
        x[:, 32:64] = 0
    x[:, 0] *= 20
    return x


# --- (a) the quantization ---------------------------------------------------------------------------------------
def test_quantize_rows_equals_the_reference():
    x = activations(7, 1536, seed=1)
    got, want = int8.quantize_rows(x), int8.quantize_rows_reference(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    qx, dx, sx = got
    assert qx.abs().max() <= 127 and qx.abs().amax(-1).min() >= 126  # the block maximum maps to +-127
    assert torch.equal(dx[:, 1], torch.zeros(7)) and torch.equal(sx[:, 1], torch.zeros(7))  # the zero block


def test_quantize_rows_zero_blocks_and_ties():
    x = torch.zeros(2, 64)
    # block 0: amax 127, so x * (127 / amax) = x: halves round to even, as _mm256_round_ps does
    x[0, :8] = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5])
    x[0, 8] = -0.0
    # block 1: amax 254, scale 0.5: 5 -> 2.5 -> 2, 7 -> 3.5 -> 4, -254 -> -127
    x[0, 32:35] = torch.tensor([5.0, 7.0, -254.0])
    # row 1: all zero (and a negative zero): q 0, dx 0, sx 0
    x[1, 3] = -0.0
    qx, dx, sx = int8.quantize_rows(x)
    assert qx[0, :9].tolist() == [127, 2, 4, -2, -4, 0, 0, 2, 0]
    assert qx[0, 32:35].tolist() == [2, 4, -127]
    assert dx[0].tolist() == [1.0, 2.0] and sx[0].tolist() == [127.0 + 2 + 4 - 2 - 4 + 2, 2.0 * (2 + 4 - 127)]
    assert not qx[1].any() and not dx[1].any() and not sx[1].any()
    for g, w in zip((qx, dx, sx), int8.quantize_rows_reference(x)):
        assert torch.equal(g, w)


# --- (b) the products -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_equals_the_reference(weights, kind, n, k):
    w = weights(kind, n, k)
    rows = range(1, 21) if n * k <= 576 * 576 else (1, 2, 3, 7, 8, 9, 10, 16, 17, 20)
    for m in rows:
        x = activations(m, k, seed=m)
        assert torch.equal(int8.int8_linear(x, w), int8.int8_linear_reference(x, w)), (kind, n, k, m)


def test_q8_0_extreme_values():
    """-128 weights (|w| = 128 as unsigned, the sign on qx) and full-scale activations: no int16 saturation."""
    n, k = 6, 128
    qs = torch.full((n, k), -128, dtype=torch.int8)
    qs[1::2] = 127
    qs[2, ::2] = -127
    w = QWeight("Q8_0", qs, torch.full((n, k // 32), 0.5))
    x = torch.full((3, k), -1.0)
    x[1] = 1.0
    x[2, ::2] = 1.0
    y = int8.int8_linear(x, w)
    assert torch.equal(y, int8.int8_linear_reference(x, w))
    assert y[0, 0].item() == pytest.approx(128 * 64.0, rel=1e-6)  # w = -64, x = -1: qx = -127 with dx = 1 / 127


def test_records_layout():
    """The repacked records: 16 outputs per record, chunk c holds weights 4c..4c+3 (low nibbles) and 16+4c.. (high)
    of each output side by side; outputs past N are zero; Q8_0 records carry q and d (fp16): a GGUF block's bytes."""
    gen = torch.Generator().manual_seed(2)
    w = QWeight.quantize(torch.randn(20, 64, generator=gen), "Q4_1")
    rec = w.int8_records()
    assert rec.shape == (2, 2, 320) and rec.dtype == torch.uint8
    q = int8.weight_ints(w).long()  # [20, 64]
    nibbles = rec[:, :, :256].view(2, 2, 4, 16, 4).long()  # [group, block, chunk, output, byte]
    for n in (0, 7, 19):
        g, o = divmod(n, 16)
        for b in range(2):
            for c in range(4):
                assert (nibbles[g, b, c, o] & 15).tolist() == q[n, 32 * b + 4 * c:32 * b + 4 * c + 4].tolist()
                assert (nibbles[g, b, c, o] >> 4).tolist() == q[n, 32 * b + 16 + 4 * c:32 * b + 20 + 4 * c].tolist()
    assert not rec[1, :, :256].view(2, 4, 16, 4)[:, :, 4:].any()  # outputs 20..31
    d, m = w.scales()
    scales = rec[:, :, 256:].contiguous().view(torch.float16).float().view(2, 2, 2, 16)  # [group, block, d|m, o]
    assert torch.equal(scales[0, :, 0].T, d[:16]) and torch.equal(scales[1, :, 1, :4].T, m[16:])
    w8 = QWeight.quantize(torch.randn(3, 32, generator=gen), "Q8_0")
    rec8 = w8.int8_records()
    assert rec8.shape == (1, 1, 544)
    assert torch.equal(rec8[0, 0, :512].view(torch.int8).view(8, 16, 4)[:, :3].permute(1, 0, 2).reshape(3, 32), w8.qs)
    assert torch.equal(rec8[0, 0, 512:].contiguous().view(torch.float16).float()[:3], w8.d[:, 0])
    assert not rec8[0, 0, 512:].contiguous().view(torch.float16)[3:].any()  # outputs 3..15


# --- (c) row invariance -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_the_pass_or_the_threads(weights, kind):
    w = weights(kind, 960, 576)
    x = activations(17, 576, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = int8.int8_linear(x, w)
        torch.set_num_threads(2)
        two_threads = int8.int8_linear(x, w)
        singles = torch.cat([int8.int8_linear(x[r:r + 1], w) for r in range(17)])
        nine = int8.int8_linear(x[4:13], w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, two_threads)
    assert torch.equal(one_thread, singles)
    assert torch.equal(one_thread[4:13], nine)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(16, 64), (67, 576), (3072, 576), (8192, 64)])
def test_every_group_once_whatever_the_threads(weights, kind, n, k):
    """The threads take a product's groups of 16 outputs as they go (parallel_chunks, kernels/cpu_kernels.h), from
    their own share's front and the others' backs: with more threads than cores (a slow thread whose share the others
    finish), one group or thousands, every output is written once, with the bits of the reference."""
    w = weights(kind, n, k)
    x = activations(3, k, seed=5)
    expected = int8.int8_linear_reference(x, w)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3, 5):
            torch.set_num_threads(t)
            for _ in range(3):
                assert torch.equal(int8.int8_linear(x, w), expected), f"{t} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_weight_gives_the_same_bits(weights, kind):
    """QWeight.stream changes only how the weight is prefetched (non-temporally), never a sum."""
    w = weights(kind, 960, 576)
    streamed = replace(w, int8=True, stream=True)
    for m in (1, 3, 9, 17):
        x = activations(m, 576, seed=m)
        assert torch.equal(int8.int8_linear(x, streamed), int8.int8_linear(x, w)), (kind, m)
        assert torch.equal(streamed.matmul(x), int8.int8_linear(x, w)), (kind, m)
    assert streamed.rows(0, 64).stream and QWeight.cat([streamed, streamed]).stream
    with pytest.raises(ValueError, match="cannot fuse"):
        QWeight.cat([streamed, w])


def int8_instructions(module) -> set[str]:
    """The mnemonics of the int8 kernel's functions in a built extension (objdump of its library)."""
    library = next((cache_root() / "kernels" / module.ddtree_build).glob("*.so"))
    text = subprocess.run([shutil.which("objdump"), "-d", "-C", "--no-show-raw-insn", str(library)],
                          capture_output=True, text=True, check=True).stdout
    mnemonics, inside = set(), False
    for line in text.splitlines():
        if line.endswith(">:"):
            inside = "ddtree_int8::" in line
        elif inside and "\t" in line:
            mnemonics.add(line.split("\t")[1].split()[0])
    return mnemonics


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.parametrize("build", ["decoding's", "avx2"])
def test_the_weight_prefetches_are_in_the_machine_code(build):
    """prefetch_record's two hints reach the machine code (GCC 12 dropped both _mm_prefetch calls, merged into one
    with a hint that is not a constant): a dropped prefetch changes no bit, only the time, so only the
    disassembly shows it."""
    module = qlinear.kernel() if build == "decoding's" else int8.build("avx2")
    assert {"prefetcht0", "prefetchnta"} <= int8_instructions(module)


# --- (d) close to the float product -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536)])
def test_close_to_the_float_product(weights, kind, n, k):
    w = weights(kind, n, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    y, want = int8.int8_linear(x, w), F.linear(x, w.dequantize())
    error = ((y - want).norm(dim=1) / want.norm(dim=1)).max().item()
    # int8 activations round each value by up to half a step of amax / 127; for Gaussian rows (amax ~2.3 sigma)
    # that is ~5e-3 relative (rms step / sqrt(12))
    assert 1e-3 < error < 1e-2, error


# --- the other builds ---------------------------------------------------------------------------------------------
def _builds_here() -> list[str]:
    """The kernel's builds this CPU runs besides decoding's: AVX2 (8 lanes, maddubs), the VNNI code paths with dpbusd
    emulated exactly (8 lanes; the Q8_0 offset path included), and the AVX-512 (16 lanes, maddubs) and real VNNI
    builds where the CPU has them."""
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    vnni512 = avx512 and "avx512_vnni" in flags
    return (["avx2", "vnni-emulated"] + (["avxvnni"] if "avx_vnni" in flags else []) + (["avx512"] if avx512 else [])
            + (["avx512vnni"] if vnni512 else []) + (["amx"] if vnni512 and {"amx_tile", "amx_int8"} <= flags else []))


@pytest.fixture
def every_pass_on_tiles():
    """A function setting a module's AMX thresholds to 1 row (every pass on the tile products, where it has them)
    for the test; the thresholds are restored after it."""
    touched = []

    def tiles(module):
        if getattr(module, "amx", False):
            touched.append((module, module.amx_rows("Q4_1", 1), module.amx_rows("Q8_0", 1)))
        return module
    yield tiles
    for module, q4, q8 in touched:
        module.amx_rows("Q4_1", q4), module.amx_rows("Q8_0", q8)


@pytest.mark.slow  # a build of the kernel per instruction set (cached after the first run)
@pytest.mark.parametrize("isa", _builds_here())
def test_every_build_gives_the_same_bits(weights, isa, every_pass_on_tiles):
    """Every build's loops (8 or 16 lanes, dpbusd or maddubs + madd, AMX tile products for every pass) give the
    reference's bits."""
    module = every_pass_on_tiles(int8.build(isa))
    assert module.isa == isa and module.vnni == (isa not in ("avx2", "avx512")) and module.amx == (isa == "amx")
    assert module.amx_active() <= (isa == "amx")  # tiles only in the amx build (where Linux grants them)
    for kind in KINDS:
        for n, k in ((67, 576), (576, 1536)):
            w = weights(kind, n, k)
            for m in (1, 3, 4, 5, 8, 9, 17):
                x = activations(m, k, seed=m)
                assert torch.equal(int8.linear_with(module, x, w), int8.int8_linear_reference(x, w)), (kind, n, m)


@pytest.mark.slow  # as above: a build per instruction set
@pytest.mark.parametrize("isa", _builds_here())
def test_every_build_at_the_extreme_integers(isa, every_pass_on_tiles):
    """Q4_1 nibbles of 15 (and a 0 per block) against activations of +-127 in every lane, the largest integer dots a
    block can have (the dpbusd loops of narrow passes sum the high nibbles as 16 x the nibble): the reference's
    bits in every build, at 1-5 rows and at 17."""
    module = every_pass_on_tiles(int8.build(isa))
    n, k = 35, 128
    gen = torch.Generator().manual_seed(3)
    w = torch.ones(n, k)
    w[:, ::32] = -1.0  # one minimum per block: the others quantize to nibble 15
    w[torch.rand(n, k, generator=gen) < 0.1] *= -1  # a few more 0 nibbles, for some variety between outputs
    qw = QWeight.quantize(w, "Q4_1")
    assert int(int8.weight_ints(qw).max()) == 15
    for m in (1, 2, 3, 4, 5, 17):
        x = torch.where(torch.rand(m, k, generator=gen) < 0.5, -1.0, 1.0)
        x[0] = 1.0  # every dot of the first row at its largest
        if m > 1:
            x[1] = -1.0
        assert torch.equal(int8.linear_with(module, x, qw), int8.int8_linear_reference(x, qw)), (isa, m)


# decoding's kernel has the tile products where its AVX-512 build sees these flags (qlinear.build_kernel)
AMX = (torch.backends.cpu.get_cpu_capability() == "AVX512"
       and {"avx512_vnni", "amx_tile", "amx_int8"} <= cpu_flags())


@pytest.mark.skipif(not AMX, reason="decoding's kernel has no AMX tile products on this CPU (no amx_int8)")
@pytest.mark.parametrize("kind", KINDS)
def test_tile_products_give_the_dpbusd_bits(weights, kind):
    """Decoding's kernel with AMX: each pass on the tile products (threshold 1) and on the dpbusd loops (threshold
    past M) gives the reference's bits, at every row count around the tiles' 16 rows and their equal chunks, with
    outputs past a group of 16 (N = 67) and a long K."""
    k = int8.kernel()
    assert k.amx  # the AVX-512 build has the tile products where the CPU has these flags
    if not k.amx_active():  # a kernel before Linux 5.16, or a hypervisor that keeps the tile state off
        pytest.skip("Linux did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): the dpbusd loops serve")
    before = k.amx_rows(kind)
    try:
        for n, kk in ((67, 576), (576, 1536)):
            w = weights(kind, n, kk)
            for m in (1, 2, 5, 8, 12, 15, 16, 17, 24, 31, 32, 33, 40):
                x = activations(m, kk, seed=100 + m)
                want = int8.int8_linear_reference(x, w)
                for threshold in (1, m + 1):
                    k.amx_rows(kind, threshold)
                    assert torch.equal(int8.int8_linear(x, w), want), (kind, n, m, threshold)
    finally:
        k.amx_rows(kind, before)


@pytest.mark.skipif(not AMX, reason="decoding's kernel has no AMX tile products on this CPU (no amx_int8)")
def test_tile_threshold_knob():
    """amx_rows reads and sets a kind's threshold (at least 1) and refuses an unknown kind."""
    k = int8.kernel()
    before = k.amx_rows("Q8_0")
    try:
        assert k.amx_rows("Q8_0", 0) == before and k.amx_rows("Q8_0") == 1  # clamped to 1 row
        assert k.amx_rows("Q8_0", 7) == 1 and k.amx_rows("Q8_0") == 7
    finally:
        k.amx_rows("Q8_0", before)
    with pytest.raises(RuntimeError, match="kind must be 'Q4_1' or 'Q8_0'"):
        k.amx_rows("Q5_0", 3)


def test_products_name_what_serves_them():
    """products() names the int8 build, and an AMX build whose tiles Linux refused as its dpbusd fallback."""
    from types import SimpleNamespace
    assert int8.products(SimpleNamespace(int8_isa="avx512vnni", int8_amx_active=lambda: False)) == "avx512vnni"
    assert int8.products(SimpleNamespace(int8_isa="amx", int8_amx_active=lambda: True)) == "amx"
    assert "not granted" in int8.products(SimpleNamespace(int8_isa="amx", int8_amx_active=lambda: False))


def test_a_build_the_cpu_cannot_run_is_refused(monkeypatch):
    """Its code would stop the process with an illegal instruction: refused, naming the missing flags."""
    from ddtree.base.config import ConfigError
    from ddtree.runtime.cpu import qlinear

    monkeypatch.setattr(qlinear, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(ConfigError, match="avx512_vnni, avx512bw, avx512f, avx512vl"):
        int8.build.__wrapped__("avx512vnni")
    with pytest.raises(ConfigError, match="avx_vnni"):
        int8.build.__wrapped__("avxvnni")
    with pytest.raises(ConfigError, match="amx_int8, amx_tile"):
        int8.build.__wrapped__("amx")


# --- (e) errors -------------------------------------------------------------------------------------------------
def test_clear_errors(weights):
    w = weights("Q4_1", 67, 576)
    x = torch.randn(2, 576)
    with pytest.raises(TypeError, match="float32"):
        int8.int8_linear(x.double(), w)
    with pytest.raises(TypeError, match=r"\[M, K\]"):
        int8.int8_linear(x[0], w)
    with pytest.raises(ValueError, match="columns"):
        int8.int8_linear(torch.randn(2, 512), w)
    with pytest.raises(TypeError, match="QWeight"):
        int8.int8_linear(x, w.dequantize())
    with pytest.raises(ValueError, match="K % 64"):
        int8.int8_linear(torch.randn(2, 32), QWeight("Q8_0", torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1)))
    with pytest.raises(ValueError, match="multiple of 32"):
        int8.quantize_rows(torch.randn(2, 48))
    # the extension checks its arguments too
    records = w.int8_records()
    with pytest.raises(RuntimeError, match="Q4_1 spans"):
        int8.kernel().pack_q4_1(w.qs[:, :9].contiguous())
    with pytest.raises(RuntimeError, match="Q8_0 scales"):
        int8.kernel().pack_q8_0(torch.zeros(4, 576, dtype=torch.int8), torch.ones(4, 9, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="fp16 values"):  # a scale no GGUF block can hold
        int8.kernel().pack_q8_0(torch.zeros(4, 576, dtype=torch.int8), torch.full((4, 18), 0.1))
    with pytest.raises(RuntimeError, match="float32"):
        int8.kernel().q4_1_linear(x.t(), records, 67)
    with pytest.raises(RuntimeError, match="pack_q8_0"):  # Q4_1 records handed to the Q8_0 product
        int8.kernel().q8_0_linear(x, records, 67)
    with pytest.raises(RuntimeError, match="groups of 16"):  # 5 groups hold 65..80 outputs
        int8.kernel().q4_1_linear(x, records, 81)
    assert int8.int8_linear(torch.zeros(0, 576), w).shape == (0, 67)
