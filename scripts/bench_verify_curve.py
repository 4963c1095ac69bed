"""The target's verify pass by row count with the int8 kernel's AMX tile products on and off, side by side.

    python scripts/bench_verify_curve.py [--rows 1,2,3,5,9,12,17,33,64] [--seconds 60] [--context 256]
        [--thresholds 12/5,1/1]

Loads the embedded pair in the integer mode (quant="gguf-int8"), fills the target's cache with `context` random
tokens, then times the verify pass of a chain of n rows (budget.calibrate's pass, not committed) for every n, in
round robin over the modes for `seconds`: "dpbusd" (every pass on the VNNI loops) and one mode per threshold pair
Q4_1/Q8_0 (the fewest rows a product takes the tile products; the kernel's defaults first). The tokens are the same
bits in every mode (tests/test_int8_linear.py); only the time differs. Prints the machine, per mode the median ms
per pass and its ratio to the 1-row pass, and per size each mode's time over dpbusd's. Needs an x86 CPU whose
AVX-512 build has AMX (lscpu: amx_int8); elsewhere it says so and stops.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ddtree
from ddtree.base.machine_load import cpu_description
from ddtree.engine.budget import _timed_chain
from ddtree.models.attention import Visibility
from ddtree.runtime.cpu import int8

KINDS = ("Q4_1", "Q8_0")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,5,9,12,17,33,64")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--thresholds", default="", help="extra Q4_1/Q8_0 threshold pairs to time, comma separated "
                    "(e.g. 8/4,1/1); the kernel's defaults are always timed")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    pair = ddtree.load(quant="gguf-int8")
    kernel = int8.kernel()
    if not (kernel.amx and kernel.amx_active()):
        raise SystemExit(f"no AMX tile products here (int8 build {kernel.isa!r}, tiles granted: "
                         f"{kernel.amx_active()}): this benchmark compares them with the dpbusd loops")
    defaults = tuple(kernel.amx_rows(kind) for kind in KINDS)
    modes = {"dpbusd": (10**9, 10**9), f"tiles {defaults[0]}/{defaults[1]} (default)": defaults}
    for pair_text in filter(None, args.thresholds.split(",")):
        q4, q8 = (int(v) for v in pair_text.split("/"))
        modes[f"tiles {q4}/{q8}"] = (q4, q8)
    target, taps = pair.target, tuple(pair.drafter.cfg.target_layer_ids)
    context = args.context
    ids = torch.randint(0, target.cfg.vocab_size, (context + max(rows),), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(context + max(rows))
    target(ids[:context], torch.arange(context), cache, Visibility.causal(0, context, target.device), taps,
           last_only=True)
    cache.commit(context)

    def once(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    passes = {n: _timed_chain(target, ids, cache, taps, context, n, once) for n in rows}
    times = {(mode, n): [] for mode in modes for n in rows}
    rounds, end = 0, time.perf_counter() + args.seconds
    try:
        while time.perf_counter() < end or rounds < 3:
            for mode, thresholds in modes.items():
                for kind, threshold in zip(KINDS, thresholds):
                    kernel.amx_rows(kind, threshold)
                for n in rows:
                    seconds = passes[n]()
                    if rounds:  # the first round warms up
                        times[mode, n].append(seconds)
            rounds += 1
    finally:
        for kind, threshold in zip(KINDS, defaults):
            kernel.amx_rows(kind, threshold)
    medians = {key: statistics.median(ts) * 1e3 for key, ts in times.items()}
    print(f"machine: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"embedded pair, gguf-int8 ({int8.products(target.kernel)}), verify of an n-row chain after {context} "
          f"tokens; median of {rounds - 1} rounds, modes interleaved\n")
    width = max(len(m) for m in modes) + 2
    header = f"{'ms per pass':{width}s}" + "".join(f"{n:>9d}" for n in rows)
    print(header)
    for mode in modes:
        print(f"{mode:{width}s}" + "".join(f"{medians[mode, n]:9.2f}" for n in rows))
    print(f"\n{'ratio to 1 row':{width}s}" + "".join(f"{n:>9d}" for n in rows))
    for mode in modes:
        base = medians[mode, rows[0]]
        print(f"{mode:{width}s}" + "".join(f"{medians[mode, n] / base:9.2f}" for n in rows))
    print(f"\n{'time / dpbusd':{width}s}" + "".join(f"{n:>9d}" for n in rows))
    for mode in list(modes)[1:]:
        print(f"{mode:{width}s}" + "".join(f"{medians[mode, n] / medians['dpbusd', n]:9.3f}" for n in rows))


if __name__ == "__main__":
    main()
