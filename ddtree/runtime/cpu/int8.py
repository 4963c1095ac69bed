"""Quantized linear layers with INTEGER activations: llama.cpp's CPU arithmetic (issue 35's groundwork).

ddtree.runtime.cpu.qlinear multiplies float activations by weights dequantized in registers; llama.cpp instead quantizes each
activation row per block of 32 to int8 (its Q8_0 / Q8_1 activations) and takes integer dot products per block, then
scales them in float. That is a different model numerically (relative error a few 1e-3 against the float product)
but cheaper per row, which is what a wide verify pass needs. kernels/int8_linear.cpp is the kernel (its top comment
states the arithmetic); this module builds it and holds a plain-torch reference of the same arithmetic, bit for bit:

    quantize_rows(x)               x [M, K] -> qx int8 [M, K], dx, sx float32 [M, K / 32]
    int8_linear(x, qweight)        x [M, K] float32 @ W^T -> y [M, N] float32, W a QWeight (Q4_1 or Q8_0)
    int8_linear_reference(x, qweight), quantize_rows_reference(x): the same in torch (for tests)

A row's result does not depend on the other rows of the pass or on the thread split (one float chain per output).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from ...base.config import ConfigError
from ...base.kernel_files import kernel_dir
from . import qlinear
from .qlinear import BLOCK, SPAN_WORDS, QWeight, compile_extension

# Builds of kernels/int8_linear.cpp as a module of its own, to compare instruction sets: avx2 (8 lanes, maddubs +
# madd), avx512 (16 lanes, maddubs + madd), avx512vnni (16 lanes) and avxvnni (8) with one dpbusd per 4 products,
# amx (avx512vnni's, with AMX-INT8 tile products for wide passes), and vnni-emulated (the VNNI code paths with an
# exact emulation of dpbusd: tests them on AVX2 machines). All give the same bits: the integer sums are exact and
# the float operations are the same. Decoding uses the copy compiled into the CPU extension (kernel()).
_AVX512_FLAGS = ["-mavx512f", "-mavx512vl", "-mavx512bw"]
ISA_FLAGS = {
    "avx2": [],
    "avx512": _AVX512_FLAGS,
    "avx512vnni": _AVX512_FLAGS + ["-mavx512vnni"],
    "amx": _AVX512_FLAGS + ["-mavx512vnni", "-mamx-tile", "-mamx-int8"],
    "avxvnni": ["-mavxvnni"],
    "vnni-emulated": ["-DDDTREE_EMULATE_VNNI"],
}
# the CPU flags (/proc/cpuinfo) a build's instructions need beyond AVX2
_AVX512 = {"avx512f", "avx512bw", "avx512vl"}
ISA_NEEDS = {"avx512": _AVX512, "avx512vnni": _AVX512 | {"avx512_vnni"},
             "amx": _AVX512 | {"avx512_vnni", "amx_tile", "amx_int8"}, "avxvnni": {"avx_vnni"}}
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-DDDTREE_INT8_MODULE"]


@functools.cache
def build(isa: str = "avx2"):
    """kernels/int8_linear.cpp alone, for `isa` (once, cached under DDTREE_CACHE/kernels by compile_extension)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {tuple(ISA_FLAGS)}, got {isa!r}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise ConfigError(f"the int8-activation kernel needs an x86 CPU with AVX2 (torch reports {capability!r})")
    missing = ISA_NEEDS.get(isa, set()) - qlinear.cpu_flags()
    if missing and qlinear.cpu_flags():  # its code would stop the process with an illegal instruction
        raise ConfigError(f"the {isa} build of the int8 kernel needs CPU flags this CPU lacks: "
                          f"{', '.join(sorted(missing))}")
    name = "ddtree_int8" + ("" if isa == "avx2" else "_" + isa.replace("-", "_"))
    return compile_extension(name, [kernel_dir() / "int8_linear.cpp"], BASE_FLAGS + ISA_FLAGS[isa],
                             f"the int8-activation CPU kernel for {isa}")


@functools.cache
def kernel() -> SimpleNamespace:
    """The int8 entry points of the CPU extension (qlinear.kernel(): int8_linear.cpp is one of its sources, built
    with VNNI where its AVX-512 build finds the CPU has it), under the names of a module of its own."""
    main = qlinear.kernel()
    return SimpleNamespace(q4_1_linear=main.int8_q4_1_linear, q8_0_linear=main.int8_q8_0_linear,
                           pack_q4_1=main.int8_pack_q4_1, pack_q8_0=main.int8_pack_q8_0,
                           quantize_rows=main.int8_quantize_rows, vnni=main.int8_vnni, isa=main.int8_isa,
                           lanes=main.int8_lanes, amx=main.int8_amx, amx_active=main.int8_amx_active,
                           amx_rows=main.int8_amx_rows)


def products(main) -> str:
    """What the int8 products of the CPU extension `main` (qlinear.kernel()) run on: its build's instruction set, and
    for the AMX build whether Linux granted the tile state (else its dpbusd passes serve every pass)."""
    if main.int8_isa == "amx" and not main.int8_amx_active():
        return "avx512vnni (AMX tiles not granted by the OS)"
    return main.int8_isa


def _check_x(x: torch.Tensor, k: int | None = None, multiple: int = BLOCK) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise TypeError(f"x must be a float32 CPU tensor [M, K], got {getattr(x, 'dtype', type(x))} "
                        f"{tuple(getattr(x, 'shape', ()))}")
    if k is not None and x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns; the weight has K = {k}")
    if x.shape[1] % multiple:
        raise ValueError(f"K must be a multiple of {multiple}, got {x.shape[1]}")
    return x.contiguous()


def _check_weight(qweight) -> tuple[int, int]:
    if not isinstance(qweight, QWeight):
        raise TypeError(f"qweight must be a ddtree.runtime.cpu.qlinear.QWeight, got {type(qweight).__name__}")
    n, k = qweight.shape
    if k % 64:
        raise ValueError(f"the kernel needs K % 64 == 0, got a {qweight.kind} weight {(n, k)}")
    return n, k


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] (K % 32 == 0) -> (qx int8 [M, K], dx float32 [M, K / 32], sx float32 [M, K / 32]), as the
    kernel quantizes its activations: per block amax = max |x|, qx = round_half_even(x * (127 / amax)) (0 where
    amax == 0), dx = amax / 127, sx = dx * sum(qx)."""
    return tuple(kernel().quantize_rows(_check_x(x)))


def int8_linear(x: torch.Tensor, qweight: QWeight) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] float32 @ W^T with int8 activations (llama.cpp's arithmetic, see the module)."""
    _, k = _check_weight(qweight)
    x = _check_x(x, k)
    return linear_with(kernel(), x, qweight)


def linear_with(module, x: torch.Tensor, qweight: QWeight) -> torch.Tensor:
    """int8_linear through `module`: kernel() or a build(isa) (whose layout of the records is the same)."""
    linear = module.q4_1_linear if qweight.kind == "Q4_1" else module.q8_0_linear
    return linear(x, qweight.int8_records(), qweight.shape[0], qweight.stream)


# --- the reference: the same arithmetic in plain torch ------------------------------------------------------------
def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rows in torch ops, each float32 operation rounded once as in the kernel."""
    x = _check_x(x)
    m, k = x.shape
    xb = x.view(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)  # [M, K / 32]
    # torch.div on two tensors: `127.0 / amax` would be reciprocal() * 127 in torch, two roundings
    inv = torch.where(amax != 0, torch.div(torch.full_like(amax, 127.0), amax), torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # half to even, as _mm256_round_ps
    dx = torch.div(amax, torch.full_like(amax, 127.0))
    sx = dx * q.sum(-1)  # the integer sum is exact in float32 (|sum| <= 32 * 127)
    return q.to(torch.int8).reshape(m, k), dx, sx


def weight_ints(qweight: QWeight) -> torch.Tensor:
    """The weight's integers q [N, K] in natural order: Q4_1 nibbles 0..15 (w = d q + m), Q8_0 int8 (w = d q)."""
    n, k = qweight.shape
    if qweight.kind == "Q8_0":
        return qweight.qs
    lanes = qweight.qs.view(n, k // 64, SPAN_WORDS)[..., None, :8]  # [N, K/64, 1, 8 lanes l]
    q = (lanes >> (4 * torch.arange(8)).view(8, 1)) & 0x0F  # [N, K/64, 8 g, 8 l]: weight 8g + l
    return q.reshape(n, k).to(torch.int8)


def int8_linear_reference(x: torch.Tensor, qweight: QWeight) -> torch.Tensor:
    """int8_linear in torch ops, bit for bit: per block the exact integer dot, then per output the float chain
    acc = acc + ((dw * dx) * isum [+ mw * sx]) over the blocks in order."""
    n, k = _check_weight(qweight)
    x = _check_x(x, k)
    qx, dx, sx = quantize_rows_reference(x)
    qw = weight_ints(qweight)
    dw, mw = qweight.scales()
    acc = torch.zeros(x.shape[0], n)
    for b in range(k // BLOCK):
        cols = slice(BLOCK * b, BLOCK * (b + 1))
        isum = (qx[:, cols].double() @ qw[:, cols].double().T).float()  # exact: integers far below 2^53 (and 2^24)
        term = (dx[:, b, None] * dw[None, :, b]) * isum
        if mw is not None:
            term = term + sx[:, b, None] * mw[None, :, b]
        acc = acc + term
    return acc
