"""GPU benchmark of the Triton tree-attention kernel (needs CUDA; written for an H100 / H200).

Shapes: bf16, Hq = 32 query heads, Hkv = 8 KV heads (GQA 4), head_dim 128, past in {1K, 4K, 16K, 32K},
tree nodes N in {16, 64, 256} (random bushy trees). K/V are views of a preallocated cache [Hkv, capacity, D],
capacity = max(past + N rounded up to a multiple of 4096, past + N + 256).
Contenders, all producing out [Hq, N, D]:
  triton         tree_attention(..., causal_tree=True) on k/v [Hkv, past+N, D] and an int past,
                 select_config's choice (split-K when it picks it)
  triton_devpast the same kernel with the past length as an int32 device tensor [1] and k/v the whole cache
                 [Hkv, capacity, D]: the kernel reads the past on the device and fixes its split count from
                 capacity - N (what a captured CUDA graph in the engine runs; it reads only past+N rows)
  triton_1split  the int-past kernel forced to one split (shows what flash decoding buys)
  sdpa_dense     F.scaled_dot_product_attention with the dense bool mask [G*N, past+N] the SDPA backend of
                 ddtree.models.attention builds (mask built once outside the timing, as it is shared by all layers)
  sdpa_split     unmasked flash attention over the past + a small masked SDPA over the tree, merged by
                 log-sum-exp. Public SDPA returns no LSE, so this uses the private ATen ops that do:
                 _scaled_dot_product_flash_attention (past) and _scaled_dot_product_efficient_attention with
                 compute_log_sumexp=True and an additive bias [G*N, N] (tree; bias built outside the timing).
                 The merge (a handful of small elementwise kernels) is timed. If a private op is unavailable
                 the tree part falls back to explicit matmuls (it is small) and the row says so.
Each contender is checked against tree_attention_reference (fp32) first (rel_err, flagged above 2e-2).

Times. Launched one at a time from Python, a few-microsecond kernel is timed mostly as Python/Triton launch
overhead, so each contender is timed by CUDA-graph replay: R calls (--calls, default 20, raised to the number
of buffer sets) captured in one torch.cuda.CUDAGraph after a warm-up on a side stream, rotating over
independent buffer sets (q, K/V cache, tree bits / masks) so that one replay touches >= 4x the L2 cache's size
of K/V (L2 size from the device properties); graph_ms = triton.testing.do_bench median of a replay / R. That
is what the engine's captured graphs pay. eager_ms is the old figure, do_bench median of one eager call on
one buffer set (what an eager engine pays, launch overhead included). Where a contender cannot be captured
the error is printed, its eager time stands in and the row is marked "eager" (timing field in the JSON).
Bandwidth = bytes that must move (K/V rows [0, past+N) once + Q + out + bits) / graph time, compared with a
measured device-to-device copy of a 2 GiB buffer (read + write bytes / time, CUDA events).
The run ends with a compact table and, per case, triton's speedup (the better of triton / triton_devpast)
over sdpa_dense and its % of copy bandwidth.
Usage: python scripts/bench_tree_attention.py [--past 1024 4096] [--nodes 16 64] [--calls 20] [--sweep];
JSON -> $OUT/tree_attention_bench.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from ddtree.base.kernel_files import kernel_module

ta = kernel_module("tree_attention")  # from kernels/, wherever ddtree runs from (ddtree/base/kernel_files.py)

HQ, HKV, HEAD_DIM = 32, 8, 128
GROUP = HQ // HKV
ATEN = torch.ops.aten  # module-level so a CPU smoke test can substitute the private CUDA-only ops
L2_FACTOR = 4  # one graph replay touches at least this many L2 sizes of K/V
MAX_BUFFER_SETS = 128  # cap on the rotation (tiny pasts would otherwise ask for thousands of sets)
CONTENDERS = ("triton", "triton_devpast", "triton_1split", "sdpa_dense", "sdpa_split")


def random_tree_ancestors(n: int, gen: torch.Generator) -> torch.Tensor:
    """bool [N, N] ancestor-or-self matrix of a random recursive tree (parents precede children)."""
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[int(torch.randint(0, i, (), generator=gen))]
    return anc


def cache_capacity(past: int, n: int) -> int:
    """Preallocated cache rows: past + N rounded up to a multiple of 4096, or past + N + 256 if that is more."""
    return max(-(-(past + n) // 4096) * 4096, past + n + 256)


def l2_bytes() -> int:
    size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    return size if size > 0 else 64 << 20  # not reported: assume 64 MiB (H100 50 MB, H200 60 MB)


def make_buffers(past: int, n: int, dtype: torch.dtype, sets: int, seed: int = 0, device: str = "cuda"):
    """`sets` independent buffer sets, each a dict: q [Hq, N, D]; k_cache, v_cache [Hkv, capacity, D]; k, v
    their [Hkv, past+N, D] views; anc bool [N, N] (its own random tree); bits (packed anc)."""
    cap = cache_capacity(past, n)
    gen = torch.Generator(device=device).manual_seed(seed)
    tree_gen = torch.Generator().manual_seed(seed)
    bufs = []
    for _ in range(sets):
        q = torch.randn(HQ, n, HEAD_DIM, generator=gen, device=device, dtype=dtype)
        k_cache = torch.randn(HKV, cap, HEAD_DIM, generator=gen, device=device, dtype=dtype)
        v_cache = torch.randn(HKV, cap, HEAD_DIM, generator=gen, device=device, dtype=dtype)
        anc = random_tree_ancestors(n, tree_gen).to(device)
        bufs.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_cache[:, : past + n],
                         v=v_cache[:, : past + n], anc=anc, bits=ta.pack_ancestor_bits(anc)))
    return bufs


def sdpa_dense_fn(q, k, v, past, anc):
    n = q.shape[1]
    mask = torch.cat([torch.ones(n, past, dtype=torch.bool, device=q.device), anc], 1).repeat(GROUP, 1)
    qf = q.reshape(HKV, GROUP * n, HEAD_DIM)[None]  # fold GQA heads into the query axis: row g * N + i

    def run():
        return F.scaled_dot_product_attention(qf, k[None], v[None], attn_mask=mask).view(HQ, n, HEAD_DIM)
    return run, "bool mask [G*N, past+N]"


def sdpa_split_fn(q, k, v, past, anc):
    n = q.shape[1]
    scale = HEAD_DIM ** -0.5
    qf = q.reshape(HKV, GROUP * n, HEAD_DIM)[None]  # [1, Hkv, G*N, D]
    kp, vp, kt, vt = k[None, :, :past], v[None, :, :past], k[None, :, past:], v[None, :, past:]
    bias = torch.zeros(GROUP * n, n, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~anc.repeat(GROUP, 1), float("-inf"))
    bias = bias.expand(1, HKV, GROUP * n, n)
    aten = ATEN
    note = "flash(past)+efficient(tree, LSE)"

    def past_part():
        out, lse = aten._scaled_dot_product_flash_attention(qf, kp, vp, 0.0, False, False, scale=scale)[:2]
        return out, lse[..., : GROUP * n]

    def tree_part():
        out, lse = aten._scaled_dot_product_efficient_attention(qf, kt, vt, bias, True, 0.0, False, scale=scale)[:2]
        return out, lse[..., : GROUP * n]

    def tree_part_manual():  # small: [Hkv, G*N, N] scores
        s = (qf.float() @ kt.float().transpose(-1, -2)) * scale + bias.float()
        return (s.softmax(-1) @ vt.float()).to(q.dtype), s.logsumexp(-1)

    try:
        tree_part()
    except (RuntimeError, TypeError) as err:
        note = f"flash(past)+manual tree ({type(err).__name__})"
        tree_part = tree_part_manual  # noqa: F811

    def run():
        o1, l1 = past_part()
        o2, l2 = tree_part()
        m = torch.maximum(l1, l2)
        w1, w2 = (l1 - m).exp_()[..., None], (l2 - m).exp_()[..., None]
        return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype).view(HQ, n, HEAD_DIM)
    return run, note


def contender_fn(name: str, buf: dict, past: int, past_dev: torch.Tensor, cfg):
    """(closure computing out [Hq, N, D] on buffer set `buf`, note)."""
    q, k, v, bits, anc = buf["q"], buf["k"], buf["v"], buf["bits"], buf["anc"]
    if name == "triton":
        return (lambda: ta.tree_attention(q, k, v, past, bits, causal_tree=True)), str(cfg)
    if name == "triton_devpast":
        kc, vc = buf["k_cache"], buf["v_cache"]
        dev_cfg = ta.select_config(GROUP * q.shape[1], kc.shape[1] - q.shape[1], HEAD_DIM, HKV, q.device)
        return ((lambda: ta.tree_attention(q, kc, vc, past_dev, bits, causal_tree=True)),
                f"capacity {kc.shape[1]}, {dev_cfg}")
    if name == "triton_1split":
        one = ta.TreeAttentionConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, 1)
        return (lambda: ta.tree_attention(q, k, v, past, bits, causal_tree=True, config=one)), ""
    if name == "sdpa_dense":
        return sdpa_dense_fn(q, k, v, past, anc)
    if name == "sdpa_split":
        return sdpa_split_fn(q, k, v, past, anc)
    raise ValueError(name)


def graph_ms(fns, calls: int) -> float:
    """ms per call: `calls` calls rotating over `fns` (one closure per buffer set) captured in one CUDA graph,
    a replay timed by do_bench (median) and divided by `calls`. Raises where the capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream (compiles, lazy module loads, workspaces)
        for _ in range(2):
            for i in range(calls):
                fns[i % len(fns)]()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fns[i % len(fns)]() for i in range(calls)]  # kept alive while the graph is replayed
    graph.replay()
    torch.cuda.synchronize()
    ms = do_bench(lambda: graph.replay(), return_mode="median")
    assert len(outs) == calls
    return ms / calls


def copy_bandwidth(nbytes: int = 2 << 30) -> tuple[float, str]:
    """Device-to-device copy bandwidth (read + write bytes / s) of an nbytes int16 buffer: CUDA events around one
    copy, median of 10 after 2 warm-ups. (A captured copy of a uint8 buffer ran at 2.78 TB/s on the H200 where
    this gives 4.1: the graph's memcpy node is not the copy kernel an eager pass runs.)"""
    x = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times[2:])[len(times[2:]) // 2]
    return 2 * nbytes / (ms * 1e-3), "events"


def sweep_configs(bufs, past, calls):
    """Try a few tile shapes around select_config's choice (int past, graph-timed with the same rotation);
    returns the best (ms, config), or None."""
    best = None
    q0 = bufs[0]["q"]
    base = ta.select_config(GROUP * q0.shape[1], past, HEAD_DIM, HKV, q0.device)
    for bm in (16, 32, 64, 128):
        for bn in (32, 64, 128):
            for splits in sorted({1, base.num_splits, 2 * base.num_splits}):
                cfg = ta.TreeAttentionConfig(bm, bn, 8 if bm >= 128 else 4, 3, splits)
                fns = [(lambda b=b: ta.tree_attention(b["q"], b["k"], b["v"], past, b["bits"], config=cfg,
                                                      causal_tree=True)) for b in bufs]
                try:
                    ms = graph_ms(fns, calls)
                except Exception:  # noqa: BLE001 - out of shared memory / registers for this shape
                    torch.cuda.synchronize()
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
    return best


def run_contender(name: str, bufs, past: int, past_dev: torch.Tensor, cfg, ref: torch.Tensor, calls: int):
    """Check one contender against `ref` on buffer set 0, time it eagerly and by graph replay over all sets:
    a row dict (past, nodes, contender, ms, graph_ms, eager_ms, timing, rel_err, note, ...), or None where it
    fails outright."""
    n = bufs[0]["q"].shape[1]
    try:
        made = [contender_fn(name, b, past, past_dev, cfg) for b in bufs]
        fns, note = [f for f, _ in made], made[0][1]
        out = fns[0]()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        del out
        eager = do_bench(fns[0], warmup=25, rep=100, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report and go on (e.g. a private SDPA op missing)
        print(f"{past:>6} {n:>4} {name:>14} failed: {type(exc).__name__}: {exc}")
        return None
    try:
        graph, timing = graph_ms(fns, calls), "graph"
    except Exception as exc:  # noqa: BLE001 - not capturable: the eager time stands in
        print(f"{past:>6} {n:>4} {name:>14} graph capture failed ({type(exc).__name__}: {exc}); "
              "using the eager time")
        torch.cuda.synchronize()
        graph, timing = None, "eager"
    return dict(past=past, nodes=n, contender=name, ms=graph if graph is not None else eager, graph_ms=graph,
                eager_ms=eager, timing=timing, calls_per_graph=calls, buffer_sets=len(bufs), rel_err=err,
                note=note)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--past", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph (R; raised to the buffer sets)")
    ap.add_argument("--sweep", action="store_true", help="also search tile shapes per case (slow)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    l2 = l2_bytes()
    copy_bw, copy_how = copy_bandwidth()
    rows, summary, esize = [], [], torch.finfo(dtype).bits // 8
    print(f"device: {torch.cuda.get_device_name()}  L2: {l2 / 2**20:.0f} MiB  copy bandwidth: "
          f"{copy_bw / 1e12:.2f} TB/s ({copy_how})  dtype: {args.dtype}")
    for past in args.past:
        for n in args.nodes:
            kv_bytes = 2 * HKV * (past + n) * HEAD_DIM * esize
            sets = min(MAX_BUFFER_SETS, max(2, math.ceil(L2_FACTOR * l2 / kv_bytes)))
            calls = max(args.calls, sets)
            bufs = make_buffers(past, n, dtype, sets, seed=past + n)
            b0 = bufs[0]
            past_dev = torch.tensor([past], dtype=torch.int32, device=b0["q"].device)
            ref = ta.tree_attention_reference(b0["q"], b0["k"], b0["v"], past, b0["anc"]).float()
            total_bytes = kv_bytes + 2 * HQ * n * HEAD_DIM * esize + b0["bits"].numel() * 4
            flops = 4 * HQ * n * (past + n) * HEAD_DIM  # QK^T + PV, dense-equivalent
            cfg = ta.select_config(GROUP * n, past, HEAD_DIM, HKV, b0["q"].device)
            print(f"-- past {past}  N {n}: {sets} buffer sets (capacity {cache_capacity(past, n)} rows), "
                  f"{calls} calls per graph, {sets * kv_bytes / l2:.1f}x L2 of K/V per replay")
            case = {}
            for name in CONTENDERS:
                row = run_contender(name, bufs, past, past_dev, cfg, ref, calls)
                if row is None:
                    continue
                ms = row["ms"]
                bw = total_bytes / (ms * 1e-3)
                row.update(bytes=total_bytes, kv_bytes=kv_bytes, flops=flops, bandwidth_Bps=bw,
                           copy_fraction=bw / copy_bw, tflops=flops / (ms * 1e-3) / 1e12)
                rows.append(row)
                case[name] = row
                graph, err = row["graph_ms"], row["rel_err"]
                flag = ("  <-- WRONG" if err > 2e-2 else "") + ("  [eager: no graph]" if graph is None else "")
                shown = f"{graph:9.4f}" if graph is not None else f"{'-':>9}"
                print(f"{past:>6} {n:>4} {name:>14} graph {shown} eager {row['eager_ms']:8.4f} ms "
                      f"{bw / 1e12:6.2f} TB/s {100 * bw / copy_bw:5.1f}% {row['tflops']:7.1f} TFLOP/s "
                      f"{err:8.1e}  {row['note']}{flag}")
            best = min((case[k] for k in ("triton", "triton_devpast") if k in case), key=lambda r: r["ms"],
                       default=None)
            if best is not None:
                dense = case.get("sdpa_dense")
                summary.append(dict(past=past, nodes=n, triton=best["contender"], triton_ms=best["ms"],
                                    sdpa_dense_ms=dense["ms"] if dense else None,
                                    speedup_vs_sdpa_dense=dense["ms"] / best["ms"] if dense else None,
                                    copy_fraction=best["copy_fraction"]))
            if args.sweep:
                found = sweep_configs(bufs, past, calls)
                if found is not None:
                    ms, cfg_best = found
                    rows.append(dict(past=past, nodes=n, contender="triton_best_sweep", ms=ms, graph_ms=ms,
                                     timing="graph", config=str(cfg_best)))
                    print(f"{past:>6} {n:>4} {'sweep best':>14} graph {ms:9.4f}  {cfg_best}")
            del bufs, b0, past_dev, ref, case
            torch.cuda.empty_cache()

    print(f"\nper call; bandwidth and %copy from graph_ms (copy {copy_bw / 1e12:.2f} TB/s); * = eager time "
          "(capture failed)")
    print("{:>6} {:>4} {:>14} {:>9} {:>9} {:>6} {:>6} {:>8}".format(
        "past", "N", "contender", "graph_ms", "eager_ms", "TB/s", "%copy", "rel_err"))
    for r in rows:
        if r["contender"] == "triton_best_sweep":
            continue
        g = f"{r['graph_ms']:9.4f}" if r["graph_ms"] is not None else f"{'*':>9}"
        print(f"{r['past']:>6} {r['nodes']:>4} {r['contender']:>14} {g} {r['eager_ms']:9.4f} "
              f"{r['bandwidth_Bps'] / 1e12:6.2f} {100 * r['copy_fraction']:5.1f}% {r['rel_err']:8.1e}"
              f"{'  WRONG' if r['rel_err'] > 2e-2 else ''}")
    print()
    for s in summary:
        speed = f"{s['speedup_vs_sdpa_dense']:.2f}x sdpa_dense" if s["speedup_vs_sdpa_dense"] else "no sdpa_dense"
        print(f"past {s['past']:>6} N {s['nodes']:>4}: {s['triton']:>14} {s['triton_ms']:.4f} ms, {speed}, "
              f"{100 * s['copy_fraction']:.1f}% of copy")
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = os.path.join(out_dir, "tree_attention_bench.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), dtype=args.dtype, copy_bandwidth_Bps=copy_bw,
                           copy_timing=copy_how, l2_bytes=l2, l2_factor=L2_FACTOR, hq=HQ, hkv=HKV,
                           head_dim=HEAD_DIM, triton=triton.__version__, torch=torch.__version__,
                           rows=rows, summary=summary), f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
