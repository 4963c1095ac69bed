"""Time the int8-activation kernel (ddtree.runtime.cpu.int8) against the float-activation one (ddtree.runtime.cpu.qlinear) on
SmolLM2-135M's layer set, all Q4_1: per layer qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536];
a "stack" is 30 such layers (~66 MB of weights, more than a typical L3, so a pass streams them from DRAM).

    PYTHONPATH=. python scripts/bench_int8_linear.py [--threads 2] [--reps 15] [--rows 1,2,3,5,9,17]
        [--int8-isas avx2,avxvnni,amx]

Prints the machine (lscpu), ms per stack pass for each row count M, and each kernel's ratio to its 1-row pass.
Weights are random spans (the timing does not depend on the values). The amx build, where it is listed, is timed
with every pass on its tile products (its thresholds set to 1 row); decoding's kernel keeps its own thresholds.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from ddtree.runtime.cpu import qlinear
from ddtree.runtime.cpu import int8
from ddtree.runtime.cpu.qlinear import SPAN_WORDS, QWeight

HIDDEN, INTER, LAYERS = 576, 1536, 30
SHAPES = {"qkv": (576 + 192 + 192, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER)}


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("Flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")
            if f in flags]
    return (f"{fields.get('Model name', '?')}, {fields.get('CPU(s)', '?')} CPUs, "
            f"L3 {fields.get('L3 cache', '?')}; SIMD: {' '.join(simd)}")


def random_q4_1(n: int, k: int, gen: torch.Generator) -> QWeight:
    """Random nibbles and small fp16 scales in the span layout."""
    spans = torch.randint(-2**31, 2**31 - 1, (n, k // 64, SPAN_WORDS), generator=gen, dtype=torch.int64)
    scales = (torch.rand(n, k // 64, 4, generator=gen) * 0.01).half().view(torch.int16).to(torch.int64) & 0xFFFF
    spans[..., 8:] = scales[..., 0::2] | (scales[..., 1::2] << 16)
    spans = torch.where(spans >= 2**31, spans - 2**32, spans).to(torch.int32)
    return QWeight("Q4_1", spans.reshape(n, k // 64 * SPAN_WORDS).contiguous())


def stack_pass(fn, layers, x_by_k) -> float:
    """ms of one pass over the whole stack."""
    t0 = time.perf_counter()
    for layer in layers:
        for w in layer.values():
            fn(x_by_k[w.shape[1]], w)
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", default="1,2,3,5,9,17")
    ap.add_argument("--int8-isas", default="", help="other builds of the int8 kernel to time beside it, comma "
                    "separated (ddtree.runtime.cpu.int8.ISA_FLAGS: avx2, avxvnni, avx512vnni, amx; the CPU must have "
                    "them; amx: every pass on the tile products)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    layers = [{name: random_q4_1(n, k, gen) for name, (n, k) in SHAPES.items()} for _ in range(LAYERS)]
    mb = sum(w.qs.numel() * 4 for layer in layers for w in layer.values()) / 1e6
    for layer in layers:  # the int8 kernel's records, made once (as a load does)
        for w in layer.values():
            w.int8_records()
    kernels = {f"int8 {int8.kernel().isa} (decoding's)": lambda x, w: int8.linear_with(int8.kernel(), x, w)}
    for isa in args.int8_isas.split(",") if args.int8_isas else ():
        module = int8.build(isa)
        if module.amx:
            module.amx_rows("Q4_1", 1), module.amx_rows("Q8_0", 1)
        kernels[f"int8 {isa} build"] = lambda x, w, module=module: int8.linear_with(module, x, w)
    kernels["float (qlinear.q4_1_linear)"] = lambda x, w: qlinear.kernel().q4_1_linear(x, w.qs)
    print(f"machine: {machine()}")
    print(f"torch {torch.__version__}, {args.threads} threads, int8 build {int8.kernel().isa}, "
          f"qlinear build {qlinear.resolve_cpu_kernel()}; stack: {LAYERS} x (qkv, o, gate_up, down) Q4_1, {mb:.1f} MB")
    # round robin over (kernel, M), so that a load from another process spreads over all of them; the minimum
    # over the repetitions is the figure least disturbed by it (the median is printed too)
    xs = {m: {k: torch.randn(m, k, generator=gen) for k in (HIDDEN, INTER)} for m in rows}
    times = {name: {m: [] for m in rows} for name in kernels}
    for rep in range(args.reps + 1):
        for name, fn in kernels.items():
            for m in rows:
                # untimed passes first: the kernels read different copies of the weights, and after another
                # kernel's passes a large L3 (which decoding's passes run from) takes a few passes to hold them again
                for _ in range(3):
                    stack_pass(fn, layers, xs[m])
                t = stack_pass(fn, layers, xs[m])
                if rep:
                    times[name][m].append(t)
    for stat in ("min", "median"):
        results = {name: {m: (min if stat == "min" else statistics.median)(ts) for m, ts in per.items()}
                   for name, per in times.items()}
        report(results, rows, stat)


def report(results, rows, stat):
    header = f"{'kernel':34s}" + "".join(f"{'M=' + str(m):>10s}" for m in rows)
    print(f"\nms per stack pass ({stat})\n" + header)
    for name, per in results.items():
        print(f"{name:34s}" + "".join(f"{per[m]:10.2f}" for m in rows))
    print(f"\nratio to the 1-row pass ({stat})\n" + header)
    for name, per in results.items():
        base = per[rows[0]]
        print(f"{name:34s}" + "".join(f"{per[m] / base:10.2f}" for m in rows))


if __name__ == "__main__":
    main()
