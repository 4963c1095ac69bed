"""GPU benchmark of the Triton tree-attention kernel (needs CUDA; written for an H100).

Shapes: bf16, Hq = 32 query heads, Hkv = 8 KV heads (GQA 4), head_dim 128, past in {1K, 4K, 16K, 32K},
tree nodes N in {16, 64, 256} (random bushy trees). K/V are views of a preallocated cache [Hkv, T_cap, D].
Contenders, all producing out [Hq, N, D]:
  triton        tree_attention(..., causal_tree=True), select_config's choice (split-K when it picks it)
  triton_1split the same kernel forced to one split (shows what flash decoding buys)
  sdpa_dense    F.scaled_dot_product_attention with the dense bool mask [G*N, past+N] the SDPA backend of
                ddtree.attention builds (mask built once outside the timing, as it is shared by all layers)
  sdpa_split    unmasked flash attention over the past + a small masked SDPA over the tree, merged by
                log-sum-exp. Public SDPA returns no LSE, so this uses the private ATen ops that do:
                _scaled_dot_product_flash_attention (past) and _scaled_dot_product_efficient_attention with
                compute_log_sumexp=True and an additive bias [G*N, N] (tree; bias built outside the timing).
                The merge (a handful of small elementwise kernels) is timed. If a private op is unavailable
                the tree part falls back to explicit matmuls (it is small) and the row says so.
Each contender is checked against tree_attention_reference (fp32) first. Times: triton.testing.do_bench
median. Bandwidth = bytes that must move (K/V rows [0, past+N) once + Q + out) / time, compared with a
measured device-to-device copy (read + write bytes / time).
Usage: python scripts/bench_tree_attention.py [--past 1024 4096] [--nodes 16 64] [--sweep]; JSON -> $OUT.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

# import_module, not `from ... import tree_attention`: the package re-exports a function of the same name.
ta = importlib.import_module("ddtree.kernels.tree_attention")

HQ, HKV, HEAD_DIM = 32, 8, 128
GROUP = HQ // HKV
ATEN = torch.ops.aten  # module-level so a CPU smoke test can substitute the private CUDA-only ops


def random_tree_ancestors(n: int, gen: torch.Generator) -> torch.Tensor:
    """bool [N, N] ancestor-or-self matrix of a random recursive tree (parents precede children)."""
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[int(torch.randint(0, i, (), generator=gen))]
    return anc


def make_case(past: int, n: int, dtype: torch.dtype, seed: int = 0, device: str = "cuda"):
    gen = torch.Generator().manual_seed(seed)
    cap = past + n + 128  # preallocated cache rows; the kernel reads only [0, past + N)
    q = torch.randn(HQ, n, HEAD_DIM, generator=gen).to(dtype).to(device)
    k_cache = torch.randn(HKV, cap, HEAD_DIM, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(HKV, cap, HEAD_DIM, generator=gen).to(dtype).to(device)
    anc = random_tree_ancestors(n, gen).to(device)
    return q, k_cache[:, : past + n], v_cache[:, : past + n], anc


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


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)  # read + write, bytes/s


def sweep_configs(q, k, v, past, bits):
    """Try a few tile shapes around select_config's choice; returns the best (ms, config)."""
    best = None
    base = ta.select_config(GROUP * q.shape[1], past, HEAD_DIM, HKV, q.device)
    for bm in (16, 32, 64, 128):
        for bn in (32, 64, 128):
            for splits in sorted({1, base.num_splits, 2 * base.num_splits}):
                cfg = ta.TreeAttentionConfig(bm, bn, 8 if bm >= 128 else 4, 3, splits)
                try:
                    ms = do_bench(lambda: ta.tree_attention(q, k, v, past, bits, config=cfg, causal_tree=True),
                                  return_mode="median")
                except Exception:  # out of shared memory / registers for this shape
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--past", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--sweep", action="store_true", help="also search tile shapes per case (slow)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    copy_bw = copy_bandwidth()
    rows, esize = [], torch.finfo(dtype).bits // 8
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {copy_bw / 1e12:.2f} TB/s  "
          f"dtype: {args.dtype}")
    header = ("past", "N", "contender", "ms", "TB/s", "%copy", "TFLOP/s", "rel_err")
    print(("{:>6} {:>4} {:>14} {:>8} {:>6} {:>6} {:>8} {:>8}  note").format(*header))
    for past in args.past:
        for n in args.nodes:
            q, k, v, anc = make_case(past, n, dtype, seed=past + n)
            bits = ta.pack_ancestor_bits(anc)
            ref = ta.tree_attention_reference(q, k, v, past, anc).float()
            kv_bytes = 2 * HKV * (past + n) * HEAD_DIM * esize
            total_bytes = kv_bytes + 2 * HQ * n * HEAD_DIM * esize + bits.numel() * 4
            flops = 4 * HQ * n * (past + n) * HEAD_DIM  # QK^T + PV, dense-equivalent
            cfg = ta.select_config(GROUP * n, past, HEAD_DIM, HKV, q.device)
            contenders = {
                "triton": (lambda: ta.tree_attention(q, k, v, past, bits, causal_tree=True), str(cfg)),
                "triton_1split": (lambda: ta.tree_attention(
                    q, k, v, past, bits, causal_tree=True,
                    config=ta.TreeAttentionConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, 1)), ""),
                "sdpa_dense": sdpa_dense_fn(q, k, v, past, anc),
                "sdpa_split": sdpa_split_fn(q, k, v, past, anc),
            }
            for name, (fn, note) in contenders.items():
                try:
                    out = fn()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                except Exception as exc:  # report and go on (e.g. a private SDPA op missing)
                    print(f"{past:>6} {n:>4} {name:>14} failed: {type(exc).__name__}: {exc}")
                    continue
                bw = total_bytes / (ms * 1e-3)
                row = dict(past=past, nodes=n, contender=name, ms=ms, bytes=total_bytes, kv_bytes=kv_bytes,
                           flops=flops, bandwidth_Bps=bw, copy_fraction=bw / copy_bw,
                           tflops=flops / (ms * 1e-3) / 1e12, rel_err=err, note=note)
                rows.append(row)
                flag = "  <-- WRONG" if err > 2e-2 else ""
                print(f"{past:>6} {n:>4} {name:>14} {ms:8.4f} {bw / 1e12:6.2f} {100 * bw / copy_bw:5.1f}% "
                      f"{row['tflops']:8.1f} {err:8.1e}  {note}{flag}")
            if args.sweep:
                ms, best = sweep_configs(q, k, v, past, bits)
                rows.append(dict(past=past, nodes=n, contender="triton_best_sweep", ms=ms, config=str(best)))
                print(f"{past:>6} {n:>4} {'sweep best':>14} {ms:8.4f}  {best}")
            del q, k, v, anc, bits, ref
            torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = os.path.join(out_dir, "tree_attention_bench.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), dtype=args.dtype, copy_bandwidth_Bps=copy_bw,
                           hq=HQ, hkv=HKV, head_dim=HEAD_DIM, triton=triton.__version__,
                           torch=torch.__version__, rows=rows), f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
