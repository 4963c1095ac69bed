"""GGUF-quantized linear layers on the CPU: weights kept in the file's own Q4_1 / Q8_0 blocks, activations float32.

Why: plain decoding on a CPU streams every weight once per token. In fp32 that is 4 bytes a weight; Q4_1 is 5 bits
and Q8_0 8.5, so a 1-token step reads ~6x / ~4x less. The kernel (kernels/qlinear.cpp, AVX2 + FMA, built once
with torch's C++ extension loader) dequantizes each block of 32 in registers, exactly as gguf-py does, so the
quantized model is exactly the float model that ddtree.models.loading converts the same GGUF into; only the order of
the float sums differs. Within this model every output row is summed in the same order whatever the number of
rows (see the kernel), so a 1-token step and a verify project a row identically.

A QWeight is the packed weight [N, K] of one linear layer (or of several fused along N); a QLinear is the
nn.Module that applies it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...base.cache import build_lock, cache_root, import_library, notice, read_manifest, replacing_dir, seal, verify
from ...base.config import CPU_KERNELS, ConfigError
from ...base.kernel_files import kernel_dir

BLOCK = 32  # weights per GGUF block (Q4_1 and Q8_0)
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # fp16 d (, fp16 m), then the 32 weights' bits
KINDS = tuple(BLOCK_BYTES)
# Above this many rows (a long prompt's prefill) a call dequantizes the weight and runs torch's float GEMM, which
# is cache-blocked; the kernel re-reads all x rows for every 4 weight rows, fine for decoding steps and verifies
# (1 to 256 + 1 rows: the largest tree budgets).
KERNEL_MAX_ROWS = 320


ISAS = ("avx2", "avx512")


def resolve_cpu_kernel(choice: str = "auto") -> str:
    """The kernel build a load runs: "avx2", "avx512", or "off" (torch's matmuls everywhere: the reference
    arithmetic, slower). choice is load()'s cpu_kernel; "auto" is "avx512" where torch reports AVX512 (F, BW, VL,
    DQ: the build then also uses the 16 extra vector registers, which let one pass take more rows), else "avx2".
    Both builds give the same bits. The environment (DDTREE_CPU_KERNEL, DDTREE_CPU_ISA) is read by load() only,
    into `choice` (ddtree/base/options.py)."""
    if choice not in CPU_KERNELS:
        raise ConfigError(f"unknown cpu_kernel {choice!r}; choose one of {', '.join(CPU_KERNELS)}")
    if choice == "auto":
        return "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2"
    return choice


@functools.cache
def cpu_kernel_available(choice: str = "auto") -> bool:
    """Can float32 CPU products use the kernel? Not where resolve_cpu_kernel(choice) is "off", without AVX2, or
    where it does not build (then once a warning, and torch's GEMM everywhere: slower, equally exact). A bad
    choice is an error, not a slower fallback."""
    if resolve_cpu_kernel(choice) == "off":
        return False
    try:
        kernel(choice)
    except ConfigError as e:
        warnings.warn(f"ddtree: the CPU matmul kernel is unavailable, using torch's ({e})", stacklevel=2)
        return False
    return True


@functools.cache
def kernel(choice: str = "auto"):
    """The compiled extension for resolve_cpu_kernel(choice) (built once per process; see build_kernel). Where an
    automatically chosen AVX-512 build fails (a compiler without those flags), the AVX2 build serves, with a
    warning. A ConfigError where the choice is "off"."""
    isa = resolve_cpu_kernel(choice)
    if isa == "off":
        raise ConfigError("the CPU kernel is turned off (cpu_kernel='off' or DDTREE_CPU_KERNEL=0), and this needs it")
    if isa == "avx512" and choice == "auto":  # chosen here, not asked for: the AVX2 build may serve
        try:
            return build_kernel(isa)
        except ConfigError as e:
            warnings.warn(f"ddtree: the AVX-512 build of the CPU kernel failed, using the AVX2 build ({e})", stacklevel=2)
            return build_kernel("avx2")
    return build_kernel(isa)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def last_level_cache_bytes() -> int | None:
    """The size of the largest cache CPU 0 sees (sysfs: its L3 on x86 servers), None where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


@functools.cache
def build_kernel(isa: str = "avx2"):
    """The compiled extension (built on first use, ~1 min; cached under DDTREE_CACHE/kernels, see
    compile_extension): the quantized products, float32 ones for the runtime's Linear, and the decoder-layer
    stack (stack.py). isa "avx512" builds the same sources with AVX-512VL/BW/DQ allowed (its own name and
    folder, so a cache shared by two kinds of CPU never loads it on one without them); every product keeps its
    order of sums, so the two builds give the same bits (tests/test_qlinear.py)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise ConfigError(f"the CPU matmul kernel needs an x86 CPU with AVX2 (torch reports {capability!r}), so "
                          "quant='gguf' cannot run here; float targets run on torch's matmuls")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    if isa == "avx512" and capability != "AVX512":
        raise ConfigError(f"the avx512 kernel (cpu_kernel='avx512' or DDTREE_CPU_ISA=avx512) on a CPU without AVX-512 "
                          f"(torch reports {capability!r}); choose cpu_kernel 'auto' or 'avx2'")
    sources = [kernel_dir() / name for name in ("qlinear.cpp", "decoder.cpp", "int8_linear.cpp", "tree.cpp")]
    # -ffp-contract=off: a product and a sum stay two roundings, as in torch's eager ops (decoder.cpp)
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
    if isa == "avx512":
        flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]
        if "avx512_vnni" in cpu_flags():  # int8 dot products in one instruction (int8_linear.cpp; same bits)
            flags.append("-mavx512vnni")
            if {"amx_tile", "amx_int8"} <= cpu_flags():  # tile products for passes of several rows (same bits)
                flags += ["-mamx-tile", "-mamx-int8"]
    return compile_extension("ddtree_qlinear" + ("" if isa == "avx2" else "_" + isa), sources, flags,
                             f"the CPU matmul kernel for {isa}",
                             fix="quant='gguf' needs it; float targets run on torch's matmuls without it")


def build_key(name: str, sources, flags) -> str:
    """12 hex digits of a hash of what a build depends on: its name, flags and torch, its sources, and the headers
    beside them (a source's `#include "x.h"` can name any of them: a changed header is a new build, not a stale
    one)."""
    sources = [Path(s) for s in sources]
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    return hashlib.sha256(repr((name, list(flags), torch.__version__)).encode()
                          + b"".join(s.read_bytes() for s in sources)
                          + b"".join(h.name.encode() + b"\0" + h.read_bytes() for h in headers)).hexdigest()[:12]


def compile_extension(name: str, sources, flags, what: str, fix: str = ""):
    """The Python extension `name` compiled from `sources` with `flags` by torch's C++ extension loader, kept in
    $DDTREE_CACHE/kernels/<name>-<key of the sources, the headers beside them, flags and torch> and sealed
    there (ddtree/base/cache.py):

    - a complete build is verified (the library's checksum) and imported as it is, without a lock, a compiler or
      a write (so a read-only cache that holds one serves it);
    - a damaged or incomplete one is never loaded (a damaged library can crash the process): it is built again,
      with a notice;
    - a build runs in a staging folder renamed into place, under a lock naming its process: a lock left by a
      stopped process is removed, a live builder is waited for.

    The module's `ddtree_build` is that folder's name, whether this process built it or loaded it (its `__file__`
    names the staging folder where this process built it: a key taken from it would differ in every later process)."""
    sources = [Path(s) for s in sources]
    folder = cache_root() / "kernels" / f"{name}-{build_key(name, sources, flags)}"
    if folder.exists():
        problems = _verify_build(folder)
        if not problems:
            return _import_build(folder)
        notice(f"{what}, compiled in {folder}, is damaged or incomplete ({'; '.join(problems)}); building it again")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot build {what} in {folder.parent} ({e.strerror or e}): set DDTREE_CACHE to a "
                          f"writable folder. {fix}") from None
    with build_lock(folder.with_name(folder.name + ".lock"), what):
        if folder.exists() and not _verify_build(folder):
            return _import_build(folder)  # built by another process while this one waited
        notice(f"building {what} (once, ~1-2 min; cached in {folder})")
        with replacing_dir(folder, what) as tmp, _still_building(what):
            try:
                from torch.utils.cpp_extension import load

                module = load(name=name, sources=[str(s) for s in sources], build_directory=str(tmp),
                              extra_cflags=list(flags), extra_ldflags=["-fopenmp"])
            except Exception as e:  # noqa: BLE001 - compiler, loader and file-system failures come in many types
                raise ConfigError(f"cannot build {what} in {folder} ({type(e).__name__}: {str(e)[-400:]}); it "
                                  "needs g++ and ninja (apt-get install g++ ninja-build, or pip install ninja). "
                                  f"{fix}") from e
            # `<name>_v<n>` (module and file) where this process built `name` before: recorded, not assumed
            library = Path(module.__file__).name
            seal(tmp, files=[library], library=library, module=module.__name__, flags=list(flags),
                 torch=torch.__version__)
    module.ddtree_build = folder.name
    return module


BUILD_NOTICE_EVERY = 20.0  # seconds between the notices that a build is still running


@contextlib.contextmanager
def _still_building(what: str):
    """A notice every BUILD_NOTICE_EVERY seconds while the compiler runs (a cold build takes a minute or two, and
    says nothing of its own)."""
    done, t0 = threading.Event(), time.monotonic()

    def beat():
        while not done.wait(BUILD_NOTICE_EVERY):
            notice(f"still building {what} ({time.monotonic() - t0:.0f} s so far)")

    thread = threading.Thread(target=beat, daemon=True, name="ddtree-build-notice")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _verify_build(folder: Path) -> list[str]:
    library = (read_manifest(folder) or {}).get("library")
    return verify(folder, required=(library,)) if isinstance(library, str) else ["no complete build recorded"]


def _import_build(folder: Path):
    manifest = read_manifest(folder)
    module = import_library(folder / manifest["library"], manifest["module"])
    module.ddtree_build = folder.name
    return module


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] (N % 4 == 0, K % 64 == 0) in the row kernel's packed layout [N / 4, K / 64, 4, 64]:
    each tile of 4 output rows stored span by span, so that the kernel (f32p_linear) reads it as one sequential
    stream. The products are f32_linear's, bit for bit."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % 4 or k % 64:
        raise ValueError(f"pack_rows needs a float32 [N, K] weight with N % 4 == 0 and K % 64 == 0, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    return weight.detach().reshape(n // 4, 4, k // 64, 64).permute(0, 2, 1, 3).contiguous()


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ConfigError(f"quantization {kind} is not supported; supported: {', '.join(KINDS)}")


SPAN_WORDS = 10  # a Q4_1 span of 64 weights in int32 words: 8 lanes of nibbles, then fp16 d0, m0, d1, m1


@dataclass
class QWeight:
    """A weight [N, K] in GGUF blocks along K. Q4_1: qs int32 [N, K / 64 * 10], per 64 weights a span of 8 lanes
    (the 4-bit values repacked: nibble g of lane l is weight 8g + l) and the two blocks' fp16 scales d0, m0, d1, m1
    (see kernels/qlinear.cpp), d None; Q8_0: qs int8 [N, K] as in the file, d float32 [N, K / 32]. Row slices and
    concatenations stay packed."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor | None = None
    int8: bool = False  # products with the activations quantized to int8 per block (llama.cpp's; kernels/int8_linear.cpp)
    # int8 only: prefetched non-temporally, for a weight that cannot stay cached between passes (a target many times
    # the last-level cache), so that its stream does not evict what can (the drafter's weights, read right after it)
    stream: bool = False
    # the same blocks in int8_linear.cpp's layout (int8_records(): made on first use, then kept)
    _records: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_kind(self.kind)
        if (self.kind == "Q4_1") != (self.d is None):
            raise ValueError("a Q4_1 weight keeps its scales inside its spans (d None); a Q8_0 weight needs d")

    @property
    def shape(self) -> tuple[int, int]:
        if self.kind == "Q4_1":
            return self.qs.shape[0], self.qs.shape[1] // SPAN_WORDS * 64
        return tuple(self.qs.shape)

    dtype = torch.float32  # of the activations it takes and returns
    device = torch.device("cpu")

    @classmethod
    def from_blocks(cls, kind: str, blocks: np.ndarray, shape: tuple[int, int]) -> "QWeight":
        """From a GGUF tensor's raw bytes, uint8 [N, K / 32 * block bytes]: per block fp16 d (, fp16 m), then qs."""
        check_kind(kind)
        n, k = shape
        if k % BLOCK:
            raise ConfigError(f"a {kind} weight needs K divisible by {BLOCK}, got {shape}")
        b = torch.from_numpy(np.array(blocks, dtype=np.uint8))  # a copy: the file is mapped read-only
        b = b.reshape(n, k // BLOCK, BLOCK_BYTES[kind])
        if kind == "Q4_1":
            if k % 64:
                raise ConfigError(f"a Q4_1 weight needs K divisible by 64 for the kernel's layout, got {shape}")
            nibbles = b[..., 4:]  # [N, K/32, 16]: byte j holds weight j (low nibble) and j + 16 (high nibble)
            q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(n, k // 64, 8, 8).to(torch.int64)
            lanes = (q << (4 * torch.arange(8)).view(8, 1)).sum(2)  # [N, K/64, 8 lanes]: weight 8g + l at nibble g
            lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)  # uint32 bits as int32
            scales = b[..., :4].reshape(n, k // 64, 8).contiguous().view(torch.int32)  # [N, K/64, 2]: d0 m0 d1 m1
            return cls(kind, torch.cat((lanes, scales), -1).reshape(n, k // 64 * SPAN_WORDS))
        d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
        return cls(kind, b[..., 2:].reshape(n, k).contiguous().view(torch.int8), d)

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str) -> "QWeight":
        """Quantize a float weight [N, K] with gguf-py (tests, and weights that come without a GGUF)."""
        import gguf

        check_kind(kind)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), qtype)
        return cls.from_blocks(kind, blocks, tuple(weight.shape))

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks' d and m (None for Q8_0), float32 [N, K / 32]."""
        if self.kind == "Q8_0":
            return self.d, None
        n, k = self.shape
        dm = self.qs.view(n, k // 64, SPAN_WORDS)[..., 8:].contiguous().view(torch.float16).float()  # [N, K/64, 4]
        return dm[..., 0::2].reshape(n, k // BLOCK), dm[..., 1::2].reshape(n, k // BLOCK)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], rounded as gguf-py rounds it: (d * q) + m."""
        n, k = self.shape
        d, m = self.scales()
        if self.kind == "Q4_1":
            lanes = self.qs.view(n, k // 64, SPAN_WORDS)[..., None, :8]
            q = ((lanes >> (4 * torch.arange(8)).view(8, 1)) & 0x0F).float()  # [N, K/64, 8 g, 8 l]: weight 8g + l
            q = q.reshape(n, k // BLOCK, BLOCK)
            return (q * d[..., None] + m[..., None]).reshape(n, k)
        return (self.qs.view(n, k // BLOCK, BLOCK).float() * d[..., None]).reshape(n, k)

    def int8_records(self) -> torch.Tensor:
        """The blocks repacked for the int8-activation kernel (kernels/int8_linear.cpp: per 16 outputs and block of
        32, one record; uint8 [ceil(N / 16), K / 32, 320 (Q4_1) or 544 (Q8_0)]: the blocks' own bytes), made once
        and kept."""
        if self._records is None:
            self._records = (kernel().int8_pack_q4_1(self.qs.contiguous()) if self.kind == "Q4_1"
                             else kernel().int8_pack_q8_0(self.qs.contiguous(), self.d.contiguous()))
        return self._records

    def rows(self, start: int, stop: int) -> "QWeight":
        """Output rows [start, stop): views, no copy."""
        return QWeight(self.kind, self.qs[start:stop], None if self.d is None else self.d[start:stop], self.int8,
                       self.stream)

    def permute_rows(self, order: torch.Tensor) -> "QWeight":
        return QWeight(self.kind, self.qs[order].contiguous(), None if self.d is None else self.d[order].contiguous(),
                       self.int8, self.stream)

    @staticmethod
    def cat(weights: list["QWeight"]) -> "QWeight":
        """Stacked along N (fused projections); all of one kind and K."""
        kinds, ks = {(w.kind, w.int8, w.stream) for w in weights}, {w.shape[1] for w in weights}
        if len(kinds) != 1 or len(ks) != 1:
            raise ValueError(f"cannot fuse weights of kinds {sorted(kinds)} and widths {sorted(ks)}")
        d = None if weights[0].d is None else torch.cat([w.d for w in weights])
        return QWeight(weights[0].kind, torch.cat([w.qs for w in weights]), d, weights[0].int8, weights[0].stream)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] float32 -> [..., N]: F.linear(x, self.dequantize()) up to the order of the sums."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.int8:  # every width: the arithmetic is the kernel's (no float equivalent to fall back on)
            linear = kernel().int8_q4_1_linear if self.kind == "Q4_1" else kernel().int8_q8_0_linear
            y = linear(x2.contiguous(), self.int8_records(), self.shape[0], self.stream)
        elif x2.shape[0] > KERNEL_MAX_ROWS:
            y = F.linear(x2, self.dequantize())
        elif self.kind == "Q4_1":
            y = kernel().q4_1_linear(x2.contiguous(), self.qs)
        else:
            y = kernel().q8_0_linear(x2.contiguous(), self.qs, self.d)
        return y.view(*lead, -1)


def po2_q8(weight: torch.Tensor, exact: bool = True) -> QWeight | None:
    """Q8_0 blocks whose scales are powers of two, for a float weight [N, K] (K % 64 == 0): per block of 32 along
    K, d = the smallest power of two with every |w| <= 127 d, and q = w / d rounded to the nearest integer.

    Why powers of two: d * q is then exact in bfloat16 as well as float32 (q has at most 7 significant bits), so a
    weight made of such values (round_po2_q8: a drafter exported with `train quantize`, stored as bf16 like any
    published drafter) is read back from these blocks with its own bits at 8.5 bits a weight instead of bf16's 16,
    and the kernel sums in one order whatever the format (kernels/qlinear.cpp): the same products, bit for bit.
    exact=True: the blocks only where they dequantize to exactly `weight` (else None); False: the rounded blocks."""
    if weight.dim() != 2 or weight.shape[1] % 64 or not weight.is_floating_point() or weight.shape[0] == 0:
        return None
    w = weight.detach().float()
    if exact and po2_q8(w[:1], exact=False).dequantize().ne(w[:1]).any():
        return None  # the first row decides most weights without quantizing the rest
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)  # [N, K / 32]
    e = torch.ceil(torch.log2(amax.double() / 127)).nan_to_num(0, 0, 0).clamp(-140, 127).to(torch.int32)
    # log2 is rounded: step the exponent to the exact smallest one with amax <= 127 * 2^e (power-of-two products
    # and comparisons are exact)
    e = e + (amax > 127 * torch.ldexp(torch.ones_like(amax), e)).int()
    e = e - (amax <= 127 * torch.ldexp(torch.ones_like(amax), e - 1)).int() * (amax > 0).int()
    d = torch.ldexp(torch.ones_like(amax), e)
    q = (blocks / d[..., None]).round().clamp(-127, 127)
    q8 = QWeight("Q8_0", q.to(torch.int8).reshape(n, k).contiguous(), d.contiguous())
    if exact and not torch.equal(q8.dequantize(), w):  # a value off its block's grid (or a subnormal corner)
        return None
    return q8


def round_po2_q8(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] rounded to the nearest values of power-of-two-scaled 8-bit blocks (po2_q8), in its dtype:
    every value is exact in bfloat16, so a bf16 checkpoint keeps them and the CPU kernel reads them as 8-bit blocks."""
    blocks = po2_q8(weight, exact=False)
    if blocks is None:
        raise ValueError(f"round_po2_q8 needs a float weight [N, K] with K % 64 == 0, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    return blocks.dequantize().to(weight.dtype)


class QLinear(nn.Module):
    """A bias-free or biased linear layer on a QWeight (no parameters of its own: inference only)."""

    def __init__(self, weight: QWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.matmul(x)
        return y if self.bias is None else y + self.bias

    def _apply(self, fn, *args, **kwargs):
        raise ConfigError("a target on quantized blocks (quant='gguf') runs on the CPU in float32 only; load it "
                          "without quant to move or convert it")


# Exact GGUF blocks (exact_blocks.py) serve passes of up to layer_max_rows() / head_max_rows() rows. The
# dequantizing pass is compute-bound past a few rows (it dequantizes in registers for every pass, and past one
# pass's rows it stores dequantized tiles and sweeps them), so wider passes keep the float weights. Where the
# crossings lie on real CPUs is in docs/cpu-speed.md.
# Both builds: the AVX2 build's one dequantizing pass takes 5 rows (its WIDE_PASS_ROWS), but its store-and-sweep
# passes beyond that still read a sixth of float32's bytes, and on a 2-core AVX2 VM they stay ahead of the float
# weights up to here; the Q8_0 head (8.5 bits a weight) as far.
BLOCK_MAX_ROWS = 12


def layer_max_rows(built=None) -> int:
    """Passes of up to this many rows read the layers' blocks: BLOCK_MAX_ROWS, or one pass of the kernel's build
    where that takes more. built: a compiled extension (kernel(choice)); None: the default build, where there is one."""
    if built is None and cpu_kernel_available():
        built = kernel()
    return max(built.wide_pass_rows, BLOCK_MAX_ROWS) if built is not None else BLOCK_MAX_ROWS


def head_max_rows(built=None) -> int:
    """Passes of up to this many rows read the LM head's blocks: as many as the layers'."""
    return layer_max_rows(built)
