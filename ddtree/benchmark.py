"""The benchmark matrix: datasets x temperatures x methods (ar, dflash, ddtree at several budgets).

    python -m ddtree.benchmark                      # quick default (fits ~30 min on a 2-core CPU)
    python -m ddtree.benchmark --full               # the paper-style matrix (hours on CPU; see --help)
    torchrun --nproc_per_node=N -m ddtree.benchmark # prompts sharded over N processes

For every prompt all methods run back to back (interleaved, `ar` first), so machine drift hits them alike;
speedup = method tokens/s / `ar` tokens/s over the same prompts (= ar time / method time at T=0, where both
produce identical tokens; at T>0 samples may differ in length). Every greedy (T=0) output is checked
against `ar`'s with the target's own logits: a tie flip (a top-2 logit margin within rounding noise) is counted,
anything else is an ERROR, printed loudly, and makes the process exit with status 1.

Each record (one prompt x method x configuration) is one JSON line in OUT/records.jsonl (per-rank shards
records.rank<R>.jsonl under torchrun, merged by rank 0). Records are keyed by a hash of the full configuration;
a re-run skips prompts whose records all exist, so an interrupted run resumes where it stopped.
Summaries: OUT/summary.md, summary.tex, summary.json; OUT/last_run.json names the records of the last run.

(`--inject-mismatch`, hidden from --help, is a self-test of the checker: it corrupts one token of the first
ddtree output before checking it, so the tests can prove that a mismatch is caught and fails the run.)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from .compare import method_label, parse_budget, parse_method
from .config import ConfigError, cli_int
from .datasets import dataset_name, load_prompts
from .files import output_dir
from .hf_baseline import HFBaseline
from .stats import STAGES

# Presets: values used for options not given on the command line.
PRESETS = {
    # Greedy and sampled, every budget, Hugging Face generate() beside ar. The 2-core AMX Xeon ran 2 prompts x
    # 64 tokens at T=0 in 2.5 min with the shipped drafter; this preset took 22 min, measured before T>0 draws
    # were limited to the walk (which shortens its T=1 half).
    "quick": dict(datasets="humaneval,mt-bench,gsm", temperatures="0,1", methods="ar,hf,dflash,ddtree",
                  budgets="16,32,64,128,256,auto", num_prompts=4, max_new_tokens=96),
    # The paper-style matrix: 20 prompts per set, 256 tokens: a few hours on that CPU, minutes on one GPU.
    "full": dict(datasets="humaneval,mt-bench,gsm", temperatures="0,1", methods="ar,hf,dflash,ddtree",
                 budgets="16,32,64,128,256,auto", num_prompts=20, max_new_tokens=256),
    # For tests: a couple of minutes including model loading.
    "tiny": dict(datasets="humaneval,mt-bench,gsm", temperatures="0", methods="ar,dflash,ddtree", budgets="16",
                 num_prompts=2, max_new_tokens=8),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddtree.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--full", action="store_true", help="paper-style matrix: " + _describe(PRESETS["full"]))
    preset.add_argument("--tiny", action="store_true", help="smoke test: " + _describe(PRESETS["tiny"]))
    p.add_argument("--datasets", help="comma-separated: humaneval, mt-bench, gsm or JSONL paths")
    p.add_argument("--temperatures", help="comma-separated, e.g. 0,1 (0 = greedy, checked against ar)")
    p.add_argument("--methods",
                   help="comma-separated; plain `ddtree` expands to every --budgets value, ddtree:N adds one "
                        "budget, hf adds Hugging Face generate() on the same weights (greedy runs only); ar is "
                        "always run (it is the reference) (default: ar,hf,dflash,ddtree)")
    p.add_argument("--budgets", help="DDTree budgets (draft nodes per step) for plain `ddtree`")
    p.add_argument("--num-prompts", type=cli_int(1), help="first N prompts of each dataset")
    p.add_argument("--max-new-tokens", type=cli_int(1))
    p.add_argument("--block-size", type=int, help="drafter block size (default: the drafter's own)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is SEED + i")
    p.add_argument("--target", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="DFlash drafter directory (default: the shipped one, else untrained)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", help="float32 or bfloat16 (default: the engine's choice for the device)")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"])
    p.add_argument("--threads", type=cli_int(1),
                   help="torch CPU threads per process (default: cores / processes; 1 on a shared machine)")
    p.add_argument("--out", default="results", help="results directory (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    # Self-test of the lossless checker: corrupt one ddtree output token before checking it, so a test can
    # prove that a mismatch is caught, reported and turns into a non-zero exit status. Never use for results.
    p.add_argument("--inject-mismatch", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    chosen = PRESETS["full" if args.full else "tiny" if args.tiny else "quick"]
    for name, value in chosen.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _describe(preset: dict) -> str:
    return ", ".join(f"{k.replace('_', '-')}={v}" for k, v in preset.items())


def method_specs(methods: str, budgets: str) -> list[tuple[str, int | str | None]]:
    """['ar', 'dflash', 'ddtree'] + budgets -> [(name, budget)], ar first, duplicates dropped. A budget is an
    integer or 'auto' (the adaptive budget); `hf` is Hugging Face generate() on the same weights (greedy only)."""
    try:
        budget_list = [parse_budget(b) for b in budgets.split(",") if b.strip()]
    except ConfigError:
        raise ConfigError(f"--budgets must be comma-separated integers or 'auto', got {budgets!r}") from None
    specs = [("ar", None)]
    for m in (m.strip() for m in methods.split(",") if m.strip()):
        if m not in ("ar", "hf", "dflash", "ddtree") and not m.startswith("ddtree:"):
            raise ConfigError(f"unknown method {m!r}; use ar, hf, dflash, ddtree, ddtree:N or ddtree:auto")
        specs += [("ddtree", b) for b in budget_list] if m == "ddtree" else [parse_method(m, 0)]
    return list(dict.fromkeys(specs))


def parse_floats(text: str, option: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise ConfigError(f"{option} must be comma-separated non-negative numbers, got {text!r}")
    return values


def record_key(fields: dict) -> str:
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def drafter_fingerprint(pair) -> str:
    """Label plus a checksum of the drafter weights: a newly trained drafter must not reuse cached records."""
    total = sum(float(p.detach().double().sum()) for p in pair.drafter.parameters())
    return f"{pair.drafter.label}:{total:.9e}"


def build_plan(args, pair, specs) -> list[dict]:
    """One group per dataset x temperature x prompt; each group lists a keyed record slot per method."""
    base = dict(target=args.target or "embedded:SmolLM2-135M-Instruct", drafter=drafter_fingerprint(pair),
                dtype=str(pair.dtype).removeprefix("torch."), device=pair.device.type, threads=args.threads,
                max_new_tokens=args.max_new_tokens, top_p=args.top_p, top_k=args.top_k, block_size=args.block_size,
                attention=args.attention, **({"inject_mismatch": True} if args.inject_mismatch else {}))
    groups = []
    for spec in args.datasets.split(","):
        name = dataset_name(spec)
        prompts = load_prompts(spec, args.num_prompts)
        for temperature in parse_floats(args.temperatures, "--temperatures"):
            for index, prompt in enumerate(prompts):
                prompt_sha = hashlib.sha1(prompt.encode()).hexdigest()[:12]
                slots = [dict(method=method_label(*s), name=s[0], budget=s[1], key=record_key(
                    {**base, "dataset": name, "prompt_index": index, "prompt_sha": prompt_sha,
                     "temperature": temperature, "seed": args.seed + index, "method": method_label(*s)}))
                    for s in specs if not (s[0] == "hf" and temperature > 0)]  # hf: greedy only
                groups.append(dict(dataset=name, temperature=temperature, prompt_index=index, prompt=prompt,
                                   prompt_sha=prompt_sha, seed=args.seed + index, slots=slots))
    return groups


def load_records(out: Path) -> dict[str, dict]:
    """All records in OUT (records.jsonl and rank shards), by key; later lines win; torn lines skipped."""
    records = {}
    for path in sorted(out.glob("records*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                records[rec["key"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash
    return records


def run_group(pair, group, args, env, sink, progress, inject: list, hf) -> list[dict]:
    """Decode one prompt with every method (ar first), check greedy outputs against ar, append records."""
    out, reference = [], None
    for slot in group["slots"]:
        name, budget = slot["name"], slot["budget"]
        progress.set_postfix_str(f"{group['dataset']} T={group['temperature']:g} #{group['prompt_index']} "
                                 f"{slot['method']}")
        if name == "hf":
            res = hf.generate(group["prompt"], args.max_new_tokens)
        else:
            res = pair.generate(group["prompt"], method=name, budget=budget or 64, block_size=args.block_size,
                                temperature=group["temperature"], top_p=args.top_p, top_k=args.top_k,
                                max_new_tokens=args.max_new_tokens, seed=group["seed"])
        tokens = list(res.token_ids)
        rec = dict(key=slot["key"], dataset=group["dataset"], temperature=group["temperature"],
                   prompt_index=group["prompt_index"], prompt_sha=group["prompt_sha"], seed=group["seed"],
                   max_new_tokens=args.max_new_tokens, top_p=args.top_p, top_k=args.top_k, **res.stats.as_dict())
        rec.update(method=slot["method"], method_name=name)  # the stats' "method" is the bare name: keep the label
        if name == "ddtree" and inject:  # --inject-mismatch: corrupt one token of the first ddtree output
            inject.clear()
            pos = len(tokens) // 2
            tokens[pos:pos + 1] = [(tokens[pos] + 1) % pair.target.cfg.vocab_size] if tokens else [0]
            rec["injected_mismatch_at"] = pos
        if name == "ar":
            reference, rec["check"] = (res.prompt_ids, tokens), "reference"
        elif group["temperature"] > 0:
            rec["check"] = "skipped (T > 0)"
        else:
            verdict = pair.check(reference[0], reference[1], tokens)
            rec["check"], rec["check_detail"] = verdict.kind, verdict.describe()
            if verdict.kind == "error":
                shout_error(rec)
        rec.update(token_ids=tokens, text=pair.decode(tokens), env=env, finished_at=time.time())
        sink.write(json.dumps(rec) + "\n")
        sink.flush()
        out.append(rec)
        progress.update(1)
    return out


def shout_error(rec: dict) -> None:
    bar = "!" * 100
    print(f"\n{bar}\nLOSSLESS CHECK FAILED: {rec['dataset']} T={rec['temperature']:g} prompt {rec['prompt_index']} "
          f"{rec['method']}: {rec.get('check_detail', '')}\n{bar}", file=sys.stderr, flush=True)


def default_threads(world: int) -> int:
    """Cores per process. On the 2-core AMX Xeon (SmolLM2-135M, bf16) two threads made a plain decoding step
    1.6x faster than one (35.9 vs 56.7 ms); but threads contending with another busy process run several times
    slower (OpenMP spin-waits), so pass --threads 1 on a shared machine."""
    return max(1, (os.cpu_count() or 1) // world)


def init_distributed(args) -> tuple[int, int]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import torch.distributed as dist

        cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local)
            args.device = f"cuda:{local}"
        # Ranks finish their shards at different times: the final barrier must wait, not time out.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(days=7))
    return rank, world


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def merge_shards(out: Path, records: dict[str, dict]) -> None:
    """Rank 0, after the barrier: rewrite records.jsonl with every record once, then drop the rank shards."""
    tmp = out / "records.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    os.replace(tmp, out / "records.jsonl")
    for shard in out.glob("records.rank*.jsonl"):
        shard.unlink()


# --- environment and summaries ------------------------------------------------------------------------------
def environment(pair, threads: int, world: int) -> dict:
    import platform

    import transformers

    return dict(torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                device=str(pair.device), dtype=str(pair.dtype).removeprefix("torch."), threads=threads,
                world_size=world, cpu=_cpu_model(), target=pair.name, drafter=pair.drafter.label,
                gpu=torch.cuda.get_device_name(pair.device) if pair.device.type == "cuda" else None,
                git_commit=_git_commit())


def _cpu_model() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _git_commit() -> str | None:
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) if head else None


def summarize(records: list[dict], specs) -> list[dict]:
    """One row per dataset x temperature x method. Speedup uses ar's time on the same prompts."""
    rows = []
    cells = list(dict.fromkeys((r["dataset"], r["temperature"]) for r in records))
    for dataset, temperature in cells:
        cell = [r for r in records if r["dataset"] == dataset and r["temperature"] == temperature]
        ar = {r["prompt_index"]: r for r in cell if r["method"] == "ar"}
        for name, budget in specs:
            recs = [r for r in cell if r["method"] == method_label(name, budget)]
            if not recs:
                continue
            secs = sum(r["seconds"] for r in recs)
            new = sum(r["new_tokens"] for r in recs)
            # Throughput ratio over the same prompts. It equals ar time / method time whenever both produce the
            # same tokens (always at T=0); at T>0 samples may stop at different lengths, which time would punish.
            ar_same = [ar[r["prompt_index"]] for r in recs if r["prompt_index"] in ar]
            ar_secs = sum(a["seconds"] for a in ar_same)
            ar_rate = sum(a["new_tokens"] for a in ar_same) / ar_secs if ar_secs else 0.0
            stages = {st: 1000 * sum(r["stage_seconds"].get(st, 0.0) for r in recs) / max(1, new) for st in STAGES}
            rows.append(dict(dataset=dataset, temperature=temperature, method=method_label(name, budget),
                             budget=budget, prompts=len(recs), new_tokens=new, seconds=secs,
                             tau=sum(sum(r["acceptance_lengths"]) for r in recs) / max(1, sum(r["steps"] for r in recs)),
                             mean_nodes=sum(sum(r.get("tree_sizes", [])) for r in recs) /
                             max(1, sum(r["steps"] for r in recs)),
                             tokens_per_second=new / secs if secs else 0.0,
                             speedup=new / secs / ar_rate if secs and ar_rate else 0.0, stage_ms_per_token=stages,
                             tie_flips=sum(r["check"] == "tie_flip" for r in recs),
                             errors=sum(r["check"] == "error" for r in recs)))
    return rows


COLUMNS = ["dataset", "T", "method", "prompts", "tau", "nodes/step", "tok/s", "speedup"] + [f"{s} ms/tok" for s in STAGES] + \
    ["tie flips", "errors"]


def _cells(row: dict) -> list[str]:
    return [row["dataset"], f"{row['temperature']:g}", row["method"], str(row["prompts"]), f"{row['tau']:.2f}",
            f"{row.get('mean_nodes', 0.0):.1f}", f"{row['tokens_per_second']:.1f}", f"{row['speedup']:.2f}x"] + \
        [f"{row['stage_ms_per_token'][s]:.1f}" for s in STAGES] + [str(row["tie_flips"]), str(row["errors"])]


def write_summaries(out: Path, rows: list[dict], env: dict) -> str:
    """summary.md (also returned, for printing), summary.tex and summary.json in OUT."""
    header = (f"target {env['target']}, drafter **{env['drafter']}**, {env['device']} {env['dtype']}, "
              f"{env['threads']} thread(s) x {env['world_size']} process(es), {env['gpu'] or env['cpu']}, "
              f"torch {env['torch']}, transformers {env['transformers']}, commit {env['git_commit']}")
    warning = ("\n> The drafter is UNTRAINED (random weights): tau is about 1 and speculative methods are slower "
               "than ar. These numbers measure overhead only, not what DFlash/DDTree achieve.\n"
               if env["drafter"] == "untrained" else "")
    md = (f"# ddtree benchmark\n\n{header}\n{warning}\nspeedup = method tokens/s / ar tokens/s on the same prompts "
          f"(= ar time / method time at T=0); "
          f"tau = tokens per target verify pass; stage columns in ms per generated token.\n\n"
          f"| {' | '.join(COLUMNS)} |\n|{'---|' * len(COLUMNS)}\n" +
          "".join(f"| {' | '.join(_cells(r))} |\n" for r in rows))
    (out / "summary.md").write_text(md)

    def tex(cell: str) -> str:
        for char in "_%#&":
            cell = cell.replace(char, "\\" + char)
        return cell[:-1] + "$\\times$" if cell.endswith("x") and cell[:-1].replace(".", "").isdigit() else cell

    latex = ("% ddtree benchmark: " + header.replace("**", "") + "\n\\begin{tabular}{lrl" + "r" * (len(COLUMNS) - 3) +
             "}\n\\toprule\n" + " & ".join(tex(c) for c in COLUMNS) + " \\\\\n\\midrule\n" +
             "".join(" & ".join(tex(c) for c in _cells(r)) + " \\\\\n" for r in rows) +
             "\\bottomrule\n\\end{tabular}\n")
    (out / "summary.tex").write_text(latex)
    (out / "summary.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _main(args) -> int:
    from tqdm import tqdm

    from . import api

    rank, world = init_distributed(args)
    args.threads = args.threads or default_threads(world)
    torch.set_num_threads(args.threads)
    out = output_dir(args.out, "--out")
    specs = method_specs(args.methods, args.budgets)
    if rank != 0:
        barrier(world)  # rank 0 loads first: the first load converts the GGUF into the shared cache
    pair = api.load(args.target, args.draft, args.device, args.dtype, args.attention)
    if rank == 0:
        barrier(world)
    env = environment(pair, args.threads, world)
    plan = build_plan(args, pair, specs)
    done = load_records(out)
    mine = plan[rank::world]  # round-robin over groups: every rank gets a mix of datasets and prompts
    todo = [g for g in mine if not all(s["key"] in done for s in g["slots"])]
    if rank == 0:
        print(f"ddtree benchmark: {len(plan)} prompt groups x {len(specs)} methods; drafter: {pair.drafter.label}; "
              f"{world} process(es); {sum(len(g['slots']) for g in todo)} runs to do on rank 0, "
              f"{len(mine) - len(todo)} groups cached", file=sys.stderr)
    errors = 0
    shard = out / ("records.jsonl" if world == 1 else f"records.rank{rank}.jsonl")
    progress = tqdm(total=sum(len(g["slots"]) for g in todo), desc=f"rank {rank}", unit="run", position=rank,
                    disable=args.no_progress, dynamic_ncols=True)
    hf = HFBaseline(pair)
    if todo:  # warm-up: first-call costs (allocator, lazy init, the adaptive budget's calibration) stay out
        for name, budget in specs:
            if name == "hf":
                hf.generate(todo[0]["prompt"], 2)
            else:
                pair.generate(todo[0]["prompt"], method=name, budget=budget or 64, block_size=args.block_size,
                              max_new_tokens=2)
    inject = [True] if args.inject_mismatch else []  # consumed by the first ddtree run
    with open(shard, "a", encoding="utf-8") as sink:
        if sink.tell() and not shard.read_bytes().endswith(b"\n"):
            sink.write("\n")  # a crash cut the last line short: never glue a new record onto it
        for group in todo:
            recs = run_group(pair, group, args, env, sink, progress, inject, hf)
            errors += sum(r["check"] == "error" for r in recs)
    progress.close()
    barrier(world)
    if rank != 0:
        return 1 if errors else 0
    records = load_records(out)
    if world > 1:
        merge_shards(out, records)
    planned = [records[s["key"]] for g in plan for s in g["slots"] if s["key"] in records]
    rows = summarize(planned, specs)
    text = write_summaries(out, rows, env)
    (out / "last_run.json").write_text(json.dumps({"keys": [r["key"] for r in planned], "env": env,
                                                   "args": vars(args)}, indent=1, default=str) + "\n")
    print(text)
    total_errors = sum(r["errors"] for r in rows)  # cached errors count too: resuming never hides a failure
    if total_errors:
        print(f"\nFAILED: {total_errors} lossless check error(s); see the lines marked LOSSLESS CHECK FAILED "
              f"and the check_detail fields in {out}/records.jsonl", file=sys.stderr)
        for rec in planned:
            if rec["check"] == "error":
                shout_error(rec)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
