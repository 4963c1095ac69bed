"""The benchmark matrix: target modes x datasets x temperatures x methods (ar, dflash, ddtree at several budgets).

    python -m ddtree.bench.benchmark                      # quick default (<= 10 min on a 2-core CPU)
    python -m ddtree.bench.benchmark --full               # the paper-style matrix (hours on CPU; see --help)
    torchrun --nproc_per_node=N -m ddtree.bench.benchmark # prompts sharded over N processes

A target mode (`--quant`) is one arithmetic of the target: `float` (the reference model) or a GGUF mode
(`gguf-int8`: llama.cpp's integer activations; the quick default runs both on a CPU). Each mode is its own model,
with its own `ar` as the reference of its methods; the modes' runs of one prompt follow each other.
For every prompt all methods run back to back (interleaved, `ar` first; runner.py, shared with `compare`),
so machine drift hits them alike; speedup = method tokens/s / `ar` tokens/s over the same prompts (= ar time /
method time at T=0, where both produce identical tokens; at T>0 samples may differ in length). The run's
total time is estimated after the warm-up and again after the first prompt. Every greedy (T=0) output is checked
against `ar`'s with the target's own logits: a tie flip (a top-2 logit margin within rounding noise) is counted,
anything else is an ERROR, printed loudly, and makes the process exit with status 1.

Each record (one prompt x method x configuration) is one JSON line in OUT/records.jsonl (per-rank shards
records.rank<R>.jsonl under torchrun, merged by rank 0). Records are keyed by a hash of the full configuration;
a re-run skips prompts whose records all exist, so an interrupted run resumes where it stopped.
Summaries: OUT/summary.md, summary.tex, summary.json; OUT/last_run.json names the records of the last run (a run
that fails part way writes them too, of the records it finished). Every prompt is checked against the target's
context when the plan is made, before any decoding (an error names its file and line, or dataset and index).
With --traces, OUT/traces.jsonl gets one line per decoding step (the tree, the target's choices, the accepted
path: traces.py), keyed like the records, of each attempt's first repeat (load_traces: a record's own run);
plot_results.py draws acceptance by depth and sibling rank from it.

(`--inject-mismatch`, hidden from --help, is a self-test of the checker: it corrupts one token of the first
ddtree output before checking it, so the tests can prove that a mismatch is caught and fails the run.)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from .. import api
from ..api import QUANTS
from ..base.config import ConfigError, cli_int
from ..base.options import LoadOptions, add_model_args, load_options_from
from ..base.cache import build_lock
from .datasets import dataset_name, load_prompt_entries
from ..base.files import output_dir
from ..base.kernel_files import kernel_dir
from ..base.machine_load import LoadMeter, busy_cores, cpu_description, default_threads
from ..engine.method_spec import SYNTAX, MethodSpec, parse_methods
from .peers import Peers, available
from .runner import LOAD_LIMIT, SPREAD_LIMIT, RunSettings, run_prompt, summarize_methods, timings
from ..engine.stats import STAGES
from ..models.protocol import reference

# Presets: values used for options not given on the command line.
PRESETS = {
    # What the project is about, in <= 10 minutes on any 2-core CPU: ar, hf, dflash, ddtree at the small budgets
    # that pay on a CPU (where narrow passes read exact GGUF blocks; 3 was the best fixed budget on code in the
    # integer mode) and 8, and auto (2 and auto also with the context lookup), greedy and sampled, on the
    # three sets, in both target modes on a CPU (the float model and llama.cpp's integer activations), every run
    # timed twice, interleaved. The run prints its own estimate after the warm-up.
    # llamacpp / llamacpp:gguf (llama.cpp on the same weights / on the target's GGUF file) need the optional
    # llama-cpp-python and are skipped with a message without it.
    "quick": dict(datasets="humaneval,mt-bench,gsm", temperatures="0,1",
                  methods="ar,hf,llamacpp,llamacpp:gguf,dflash,ddtree,ddtree:2+lookup,ddtree:auto+lookup",
                  budgets="2,3,4,8,auto", num_prompts=2, max_new_tokens=64, quant="auto", repeats=2),
    # The paper-style matrix and the budget sweep: 20 prompts per set, 256 tokens: hours on a 2-core CPU,
    # minutes on one GPU.
    "full": dict(datasets="humaneval,mt-bench,gsm", temperatures="0,1",
                 methods="ar,hf,llamacpp,llamacpp:gguf,dflash,ddtree,ddtree:2+lookup,ddtree:auto+lookup",
                 budgets="2,3,4,8,16,32,64,128,256,512,auto", num_prompts=20, max_new_tokens=256, quant="auto",
                 repeats=3),
    # For tests: a couple of minutes including model loading.
    "tiny": dict(datasets="humaneval,mt-bench,gsm", temperatures="0", methods="ar,dflash,ddtree", budgets="16",
                 num_prompts=2, max_new_tokens=8, quant="float", repeats=2),
}

# The target modes a run can compare (`--quant`): "float" is load(quant=None), the reference model in the
# engine's default dtype; the others are load()'s quant values. "auto" is float, plus gguf-int8 where it runs
# (a CPU and a GGUF target: the embedded default included).
TARGET_MODES = ("float",) + QUANTS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddtree.bench.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--full", action="store_true", help="paper-style matrix: " + _describe(PRESETS["full"]))
    preset.add_argument("--tiny", action="store_true", help="smoke test: " + _describe(PRESETS["tiny"]))
    p.add_argument("--datasets", help="comma-separated: humaneval, mt-bench, gsm or JSONL paths")
    p.add_argument("--temperatures", help="comma-separated, e.g. 0,1 (0 = greedy, checked against ar)")
    p.add_argument("--methods",
                   help=f"comma-separated: {SYNTAX}; plain `ddtree` expands to every --budgets value, hf is Hugging "
                        "Face generate() on the same weights, llamacpp llama.cpp's decoding of the same weights and precision and "
                        "llamacpp:gguf of the target's own GGUF file (greedy runs only; skipped with a message "
                        "without llama-cpp-python); ar is always run (it is the reference) (default: the preset's)")
    p.add_argument("--budgets", help="DDTree budgets for plain `ddtree`: integers >= 1 (draft nodes per step) or auto")
    p.add_argument("--num-prompts", type=cli_int(1), help="first N prompts of each dataset")
    p.add_argument("--repeats", type=cli_int(1),
                   help="time each prompt x method this many times, round after round (interleaved with the other "
                        "methods); a cell reports the median and range over them (default: the preset's: quick 2, "
                        "full 3, tiny 2)")
    p.add_argument("--no-retime", action="store_true",
                   help="do not time again, once, the prompts whose runs met a busy machine (other processes on "
                        f"more than {LOAD_LIMIT} cores); they stay flagged")
    p.add_argument("--update-readme", metavar="PATH", nargs="?", const="README.md",
                   help="write this run's headline tables into PATH (default: README.md, in a checkout's root) "
                        "between its benchmark-results markers")
    p.add_argument("--max-new-tokens", type=cli_int(1))
    p.add_argument("--block-size", type=int, help="drafter block size (default: the drafter's own)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is SEED + i")
    add_model_args(p, quant=False)  # the CLI's model flags (ddtree/base/options.py); --quant is the modes below
    p.add_argument("--quant", metavar="MODES",
                   help="target modes, comma-separated, each a full run of every method beside the others: float "
                        "(the reference model, float activations), gguf (the target's GGUF's own Q4_1 / Q8_0 blocks, "
                        "float32 activations), gguf-int8 (the same blocks with int8 activations: llama.cpp's "
                        "arithmetic); auto = float,gguf-int8 on a CPU with a GGUF target, float elsewhere "
                        "(default: the preset's: auto; --tiny: float)")
    p.add_argument("--sync-stages", action="store_true",
                   help="on CUDA: synchronize at every stage edge, so each stage column carries its own GPU time "
                        "(off: the columns are host times and the speed figures are measured without the syncs)")
    p.add_argument("--out", default="results", help="results directory (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    p.add_argument("--traces", action="store_true",
                   help="write per-step tree traces to OUT/traces.jsonl (timings then include the time to record "
                        "them, so traced records are kept apart from untraced ones)")
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


def target_modes(text: str, args) -> list[str]:
    """--quant's modes, in order. auto: float, then gguf-int8 where the target and device allow it."""
    if text.strip() == "auto":
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            api.check_quant("gguf-int8", args.target, device, args.dtype,
                            api.resolve_cpu_kernel(LoadOptions.resolve(cpu_kernel=args.cpu_kernel).kernel))
        except ConfigError:
            return ["float"]
        return ["float", "gguf-int8"]
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in TARGET_MODES]
    if not modes or bad or len(set(modes)) < len(modes):
        raise ConfigError(f"--quant must be auto or comma-separated distinct target modes from "
                          f"{', '.join(TARGET_MODES)}; got {text!r}")
    return modes


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


def code_fingerprint() -> str:
    """A checksum of the code that decodes (the package's Python files and the kernels' sources): a record measured
    with other code, or on another machine, is measured again rather than reused (a re-run resumes only a run of
    the same code)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha1(f"{cpu_description()} torch {torch.__version__}".encode())
    for root, pattern in ((package, "**/*.py"), (kernel_dir(), "*")):
        for path in sorted(root.glob(pattern)):
            if path.is_file() and path.suffix in (".py", ".cpp", ".h"):
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def drafter_label(pair) -> str:
    """The drafter's label, and its n-gram table's size where the lookup falls back on one (ngram_table.py)."""
    table = pair.ngram_table
    return pair.drafter.label + (f" + n-gram table ({len(table):,} 3-grams)" if table is not None else "")


def drafter_fingerprint(pair) -> str:
    """Label plus a checksum of the drafter weights (and of the table's keys): a newly trained drafter, or another
    table, must not reuse cached records."""
    total = sum(float(p.detach().double().sum()) for p in reference(pair.drafter).parameters())
    table = pair.ngram_table
    keys = f":{int(table.keys.sum(dtype='uint64'))}" if table is not None else ""
    return f"{drafter_label(pair)}:{total:.9e}{keys}"


def dtype_label(pair) -> str:
    """The pair's dtype, with the target's quantization when it runs on GGUF blocks: "float32 gguf Q4_1/Q8_0"."""
    quant = pair.target.quant
    return str(pair.dtype).removeprefix("torch.") + (f" {quant}" if quant else "")


def check_context(pair, items) -> None:
    """Every prompt (load_prompt_entries' items) within the target's context, found when the plan is made, before
    any decoding: a ConfigError naming the first one that is not, by its file and line or dataset and index."""
    if pair.tokenizer is None:  # the runs refuse a text prompt themselves (the prompt's length is unknown)
        return
    limit = pair.target.cfg.max_position_embeddings
    for prompt, _, where in items:
        try:
            n = len(pair.encode(prompt, chat=RunSettings.chat))  # as the runs encode it: in the chat template
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if n > limit:
            raise ConfigError(f"{where}: the prompt has {n} tokens, more than the target's context limit of {limit}; "
                              "shorten it or leave it out")


def build_plan(args, pair, specs, mode: str = "float") -> list[dict]:
    """One group per dataset x temperature x prompt of target mode `mode` (run on `pair`); each group lists a
    keyed record slot per method."""
    base = dict(target=args.target or "embedded:SmolLM2-135M-Instruct", drafter=drafter_fingerprint(pair),
                code=code_fingerprint(),
                dtype=dtype_label(pair), device=pair.device.type, threads=args.threads, repeats=args.repeats,
                max_new_tokens=args.max_new_tokens, top_p=args.top_p, top_k=args.top_k, block_size=args.block_size,
                attention=args.attention, **({"inject_mismatch": True} if args.inject_mismatch else {}),
                **({"traces": True} if args.traces else {}))
    groups = []
    for spec in args.datasets.split(","):
        name = dataset_name(spec)
        items = load_prompt_entries(spec, args.num_prompts)
        check_context(pair, items)
        for temperature in parse_floats(args.temperatures, "--temperatures"):
            for index, (prompt, stop, _) in enumerate(items):
                prompt_sha = hashlib.sha1(prompt.encode()).hexdigest()[:12]
                peers_run = RunSettings(temperature=temperature, stop=stop).peers_run  # hf, llamacpp: greedy, no stops
                slots = [dict(method=s.label, spec=s, key=record_key(
                    {**base, "dataset": name, "prompt_index": index, "prompt_sha": prompt_sha,
                     "temperature": temperature, "seed": args.seed + index, "method": s.label,
                     **({"stop": list(stop)} if stop else {})}))
                    for s in specs if peers_run or not s.peer]
                groups.append(dict(mode=mode, dataset=name, temperature=temperature, prompt_index=index, prompt=prompt,
                                   prompt_sha=prompt_sha, seed=args.seed + index, stop=stop, slots=slots))
    return groups


def _json_objects(path: Path) -> Iterator[dict]:
    """The JSON objects of a JSON-lines file (records, traces), one per line; a line cut short by a crash, which is
    no JSON object, is skipped."""
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            yield row


def load_runs(out: Path) -> dict[str, dict[int, dict[int, dict]]]:
    """Every timed run in OUT (records.jsonl and rank shards): key -> attempt -> repeat -> the run's line (a later
    line wins); torn lines are skipped. A line without a repeat index (a record written before runs were stored
    one by one) counts as a finished attempt of its own."""
    runs: dict[str, dict[int, dict[int, dict]]] = {}
    for path in sorted(out.glob("records*.jsonl")):
        for rec in _json_objects(path):
            try:
                runs.setdefault(rec["key"], {}).setdefault(rec.get("attempt", 1), {})[rec.get("repeat", 0)] = rec
            except (KeyError, TypeError):
                continue  # no key, or an attempt or repeat that is no index: not a whole line
    return runs


def merged_record(attempts: dict[int, dict[int, dict]]) -> dict:
    """A key's record: the runs of its latest attempt, merged (merge_repeats), with `attempt` and how many."""
    attempt = max(attempts)
    runs = [attempts[attempt][i] for i in sorted(attempts[attempt])]
    if len(runs) == 1 and "repeat" not in runs[0]:
        return runs[0]  # already a merged record
    return dict(merge_repeats(runs), attempt=attempt)


def load_records(out: Path) -> dict[str, dict]:
    """The records in OUT, by key: each the merge of its latest attempt's runs."""
    return {key: merged_record(attempts) for key, attempts in load_runs(out).items()}


def load_traces(out: Path) -> dict[str, list[dict]]:
    """OUT/traces.jsonl by key: the steps of the run its record takes its counts from (its latest attempt's repeat
    0), in order. A prompt timed again writes its trees again, as an adaptive budget's trees follow the timings;
    a resumed run may write a step twice (the last line kept); a line cut short by a crash is skipped."""
    path = out / "traces.jsonl"
    if not path.is_file():
        return {}
    by_key: dict[str, dict[tuple[int, int], dict]] = {}
    for step in _json_objects(path):
        try:
            by_key.setdefault(step["key"], {})[(step.get("attempt", 1), step["step"])] = step
        except (KeyError, TypeError):
            continue  # not a whole line
    latest = {}
    for key, steps in by_key.items():
        attempt = max(a for a, _ in steps)
        latest[key] = [steps[k] for k in sorted(steps) if k[0] == attempt]
    return latest


def run_group(pair, group, args, env, sinks, progress, inject: list, peers, meter: LoadMeter, attempt: int,
              repeat: int) -> list[dict]:
    """Decode one prompt once with every method (runner.run_prompt: ar first, greedy outputs checked against
    its), each run with the machine's load while it ran, and append one line per run to the sinks. With --traces
    every run records its trace (so every repeat is timed alike) and each attempt's repeat 0 writes it, the run
    whose counts its record keeps (an adaptive budget's trees follow the timings: they can differ between runs;
    load_traces reads the latest attempt's). The repeats of a prompt are passes over the whole plan, so a slow
    minute of the machine meets one repeat of a prompt, not all."""
    settings = RunSettings(args.max_new_tokens, group["temperature"], args.top_p, args.top_k, args.block_size,
                           trace=args.traces, stop=group["stop"])
    fields = dict(mode=group["mode"], dataset=group["dataset"], temperature=group["temperature"],
                  prompt_index=group["prompt_index"], prompt_sha=group["prompt_sha"], seed=group["seed"],
                  max_new_tokens=args.max_new_tokens, top_p=args.top_p, top_k=args.top_k)
    keys = {slot["method"]: slot["key"] for slot in group["slots"]}

    def tamper(spec, tokens, rec):  # --inject-mismatch: corrupt one token of the first tree method's output
        if spec.info.takes_budget and inject:
            inject.clear()
            pos = len(tokens) // 2
            tokens[pos:pos + 1] = [(tokens[pos] + 1) % pair.target.cfg.vocab_size] if tokens else [0]
            rec["injected_mismatch_at"] = pos
        return tokens

    def on_run(rec):
        rec["load"] = meter.lap()  # other processes' cores during this run (and its check)
        rec.update(key=keys[rec["method"]], **fields, attempt=attempt, repeat=repeat, env=env,
                   finished_at=time.time())
        if rec["check"] == "error":
            shout_error(rec)
        trace = rec.pop("trace", None) or []  # never in the record itself
        for i, step in enumerate(trace if repeat == 0 else ()):
            sinks["traces"].write(json.dumps(dict(key=rec["key"], method=rec["method"], step=i, attempt=attempt,
                                                  **fields, **step)) + "\n")
        sinks["records"].write(json.dumps(rec) + "\n")
        sinks["records"].flush()
        progress.set_postfix_str(f"{group['dataset']} T={group['temperature']:g} #{group['prompt_index']} "
                                 f"{rec['method']} ({repeat + 1}/{args.repeats})")
        progress.update(1)

    meter.lap()  # the first run's lap starts here
    return run_prompt(pair, group["prompt"], [slot["spec"] for slot in group["slots"]], settings, group["seed"],
                      peers, tamper, on_run)


def merge_repeats(runs: list[dict]) -> dict:
    """One record from a method's repeated runs of one prompt: the first run's tokens, checks and counts (every
    run decodes the same tokens: greedy, or sampled with the same seed; a difference is recorded), each run's
    timing and load under `repeats`, and the medians as the record's own times."""
    first = runs[0]
    rec = {k: v for k, v in first.items() if k not in ("load", "repeat", "finished_at")}
    rec["repeats"] = [dict(seconds=r["seconds"], time_to_first_token=r["time_to_first_token"], load=r.get("load"))
                      for r in runs]
    rec["finished_at"] = max(r.get("finished_at", 0.0) for r in runs)
    for name in ("seconds", "time_to_first_token"):
        rec[name] = statistics.median(r[name] for r in runs)
    rec["stage_seconds"] = {stage: statistics.median(r["stage_seconds"].get(stage, 0.0) for r in runs)
                            for stage in first["stage_seconds"]}
    rec["tokens_per_second"] = rec["new_tokens"] / rec["seconds"] if rec["seconds"] else 0.0
    rec["decode_seconds"] = max(0.0, rec["seconds"] - rec["time_to_first_token"])
    rec["decode_tokens_per_second"] = (  # GenerationStats' rule, on the median times
        (rec["new_tokens"] - 1) / rec["decode_seconds"]
        if rec["new_tokens"] >= 2 and rec["decode_seconds"] > 0 and rec["time_to_first_token"] > 0 else 0.0)
    loads = [r["load"] for r in runs if r.get("load") is not None]
    rec["load"] = max(loads) if loads else None
    failed = next((r for r in runs if r["check"] == "error"), None)  # a failed check in any run fails the record
    if failed is not None:
        rec["check"], rec["check_detail"] = failed["check"], failed.get("check_detail", "")
    if any(r["token_ids"] != first["token_ids"] for r in runs[1:]):
        rec["repeats_differ"] = True  # not a lossless failure (each run is checked), but worth knowing
    return rec


WARMUP_TOKENS = 8


def _prompt_of(group: dict) -> tuple:
    """What a group decodes, whatever its target mode: its dataset, temperature and prompt."""
    return group["dataset"], group["temperature"], group["prompt_index"]


def estimate_seconds(measured: list[dict], groups: list[dict], args, repeats: int | None = None) -> float:
    """Seconds the runs of `groups` should take, from `measured` records (each with its target `mode`): per mode
    and method its prefill plus its seconds per generated token times max_new_tokens (what was not measured takes
    the slowest one's), times the repeats."""
    rates = {(r["mode"], r["method"]): (r["time_to_first_token"], (r["seconds"] - r["time_to_first_token"]) /
                                        max(1, r["new_tokens"] - 1)) for r in measured}
    slowest = max(rates.values(), key=lambda rate: rate[1], default=(0.0, 0.0))
    return (repeats or getattr(args, "repeats", 1)) * sum(first + per_token * args.max_new_tokens
               for g in groups for slot in g["slots"]
               for first, per_token in [rates.get((g["mode"], slot["method"]), slowest)])


def _minutes(seconds: float) -> str:
    return f"~{seconds / 60:.1f} min (ends about {time.strftime('%H:%M', time.localtime(time.time() + seconds))})"


def say(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[benchmark] {message}", file=sys.stderr)


def shout_error(rec: dict) -> None:
    bar = "!" * 100
    print(f"\n{bar}\nLOSSLESS CHECK FAILED: {rec['dataset']} T={rec['temperature']:g} prompt {rec['prompt_index']} "
          f"{rec['method']}: {rec.get('check_detail', '')}\n{bar}", file=sys.stderr, flush=True)


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


def merge_shards(out: Path) -> None:
    """Rank 0, after the barrier: append the ranks' runs to records.jsonl and their traces to traces.jsonl, then
    drop the rank shards."""
    for kind in ("records", "traces"):
        for shard in sorted(out.glob(f"{kind}.rank*.jsonl")):
            with open(out / f"{kind}.jsonl", "a", encoding="utf-8") as f:
                f.write(shard.read_text())
            shard.unlink()


# --- environment and summaries ------------------------------------------------------------------------------
def environment(pair, threads: int, world: int) -> dict:
    import platform

    import transformers

    return dict(torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                device=str(pair.device), dtype=dtype_label(pair), threads=threads,
                world_size=world, cpu=cpu_description(), target=pair.name, drafter=drafter_label(pair),
                gpu=torch.cuda.get_device_name(pair.device) if pair.device.type == "cuda" else None,
                git_commit=_git_commit(), date=time.strftime("%Y-%m-%d"))


def _git_commit() -> str | None:
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) if head else None


def record_mode(rec: dict) -> str:
    """A record's target mode (records written before modes were recorded ran the one their env's dtype names)."""
    dtype = rec.get("env", {}).get("dtype", "")
    return rec.get("mode") or ("gguf-int8" if dtype.endswith(" int8") else "gguf" if " gguf" in dtype else "float")


def summarize(records: list[dict], specs: list[MethodSpec]) -> list[dict]:
    """One row per target mode x dataset x temperature x method (runner.summarize_methods: speedup over the same
    mode's ar, same prompts)."""
    rows = []
    cells = list(dict.fromkeys((record_mode(r), r["dataset"], r["temperature"]) for r in records))
    modes = list(dict.fromkeys(mode for mode, _, _ in cells))
    for mode, dataset, temperature in sorted(cells, key=lambda cell: modes.index(cell[0])):  # a mode's rows together
        cell = [r for r in records
                if record_mode(r) == mode and r["dataset"] == dataset and r["temperature"] == temperature]
        rows += [dict(mode=mode, dataset=dataset, temperature=temperature, **row)
                 for row in summarize_methods(cell, specs)]
    return rows


COLUMNS = ["mode", "dataset", "T", "method", "prompts", "tau", "nodes/step", "tok/s", "speedup (range)",
           "decode tok/s", "decode speedup (range)"] + \
    [f"{s} ms/tok" for s in STAGES] + ["agrees with ar", "tie flips", "errors", "flagged"]


def _ratio(value: float | None, span: list[float] | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + (f" ({span[0]:.2f}-{span[1]:.2f})" if span and span[1] - span[0] >= 0.005 else "")


def _cells(row: dict) -> list[str]:
    decode = row.get("decode_tokens_per_second")
    return [row["mode"], row["dataset"], f"{row['temperature']:g}", row["method"], str(row["prompts"]),
            f"{row['tau']:.2f}", f"{row.get('mean_nodes', 0.0):.1f}", f"{row['tokens_per_second']:.1f}",
            _ratio(row["speedup"], row.get("speedup_range")), "-" if decode is None else f"{decode:.1f}",
            _ratio(row.get("decode_speedup"), row.get("decode_speedup_range"))] + \
        [f"{row['stage_ms_per_token'][s]:.1f}" for s in STAGES] + \
        ["-" if row.get("agreement") is None else f"{100 * row['agreement']:.0f}%"] + \
        [str(row["tie_flips"]), str(row["errors"]), "FLAGGED: " + row["flagged"] if row.get("flagged") else ""]


def best_fixed(rows: list[dict]) -> list[dict]:
    """Per target mode x dataset x temperature, the fixed DDTree budget with the highest median end-to-end speedup:
    the DDTree paper's view (its table takes the best budget per row), chosen after the run, unlike `auto`; plain
    DDTree's budgets only (not `+lookup`'s)."""
    best = {}
    for r in rows:
        spec = MethodSpec.parse(r["method"])
        if isinstance(r.get("budget"), int) and spec.info.takes_budget and not spec.lookup:
            cell = (r["mode"], r["dataset"], r["temperature"])
            if cell not in best or r["speedup"] > best[cell]["speedup"]:
                best[cell] = r
    return [dict(mode=m, dataset=d, temperature=t, method=r["method"], budget=r["budget"], speedup=r["speedup"],
                 decode_speedup=r.get("decode_speedup"), tau=r["tau"], flagged=r.get("flagged"))
            for (m, d, t), r in best.items()]


def machine_line(env: dict) -> str:
    return (f"{env.get('gpu') or env['cpu']}, {env['threads']} thread(s) x {env['world_size']} process(es), "
            f"{env.get('repeats', 1)} timed repeat(s) per run, {env.get('date', '')}, commit {env['git_commit']}")


def _show(r: dict | None, decode: bool = True, label: str = "") -> str:
    """A headline cell: the median speedup end to end / decode only, tau in parentheses, † when flagged."""
    if r is None:
        return "-"
    mark = " †" if r.get("flagged") else ""
    if not decode:
        return f"{label}{r['speedup']:.2f}x{mark}"
    dec = "-" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x"
    return f"{label}{r['speedup']:.2f}x / {dec} ({r['tau']:.2f}){mark}"


def headline(rows: list[dict], env: dict) -> str:
    """The headline tables, one per target mode: a row per dataset and temperature, a column per method; each
    cell the median speedup over `ar` end to end / decode only, and tau; `best fixed` is the paper's view;
    cells marked † are flagged (the rows below say why)."""
    lines = []
    best = {(b["mode"], b["dataset"], b["temperature"]): b for b in best_fixed(rows)}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        methods = [m for m in dict.fromkeys(r["method"] for r in mine) if m != "ar"]
        lines += [f"**{mode}** ({env.get('modes', {}).get(mode, '')})", "",
                  "| set, T | ar tok/s | " + " | ".join(methods) + " | best fixed |",
                  "|---|---:|" + "---:|" * (len(methods) + 1)]
        for dataset, temperature in dict.fromkeys((r["dataset"], r["temperature"]) for r in mine):
            cell = {r["method"]: r for r in mine if r["dataset"] == dataset and r["temperature"] == temperature}
            ar, b = cell.get("ar"), best.get((mode, dataset, temperature))
            ar_text = "-" if ar is None else f"{ar['tokens_per_second']:.1f}" + (" †" if ar.get("flagged") else "")
            lines.append(f"| {dataset}, {temperature:g} | {ar_text} | " + " | ".join(_show(cell.get(m)) for m in methods)
                         + f" | {_show(b, label=str(b['budget']) + ': ') if b else '-'} |")
        lines.append("")
    return "\n".join(lines)


def step_costs(rows: list[dict]) -> str:
    """Per target mode, what a decoding step costs, ms (medians over the repeats per record, summed over the
    prompts, over the steps): the whole step, its draft pass against `ar`'s whole step, its verify pass against
    `ar`'s, and the rest (tree build, compile, commit, the loop). Methods without stage timers (hf, llama.cpp)
    are left out."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode and r.get("stage_ms_per_step", {}).get("verify")]
        if not mine:
            continue
        lines += [f"**{mode}**", "", "| set, T | method | nodes/step | tau | step | draft (of ar's step) | "
                  "verify (x ar's) | rest |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for dataset, temperature in dict.fromkeys((r["dataset"], r["temperature"]) for r in mine):
            cell = [r for r in mine if r["dataset"] == dataset and r["temperature"] == temperature]
            ar = next((r for r in cell if r["method"] == "ar"), None)
            for r in cell:
                stage = r["stage_ms_per_step"]
                draft, verify = stage.get("draft", 0.0), stage["verify"]
                share = f" ({100 * draft / ar['ms_per_step']:.0f}%)" if ar and ar["ms_per_step"] and draft else ""
                times = f" ({verify / ar['stage_ms_per_step']['verify']:.2f}x)" if ar and r is not ar else ""
                lines.append(f"| {dataset}, {temperature:g} | {r['method']} | {r.get('mean_nodes', 0.0):.1f} | "
                             f"{r['tau']:.2f} | {r['ms_per_step']:.2f} | {draft:.2f}{share} | {verify:.2f}{times} | "
                             f"{r['ms_per_step'] - draft - verify:.2f} |")
        lines.append("")
    return "\n".join(lines)


def readme_table(rows: list[dict], env: dict) -> str:
    """The README's table: every target mode side by side in one cell (end-to-end speedups, the first mode's tau),
    with the machine, date and commit it was measured on."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m not in ("ar", "hf")]
    best = {(b["mode"], b["dataset"], b["temperature"]): b for b in best_fixed(rows)}
    by = {(r["mode"], r["dataset"], r["temperature"], r["method"]): r for r in rows}
    lines = [f"Measured by `bash run_benchmark.sh --update-readme` on {machine_line(env)}; drafter {env['drafter']}. "
             f"Cells: speedup over `ar`, end to end, per target mode ({' / '.join(modes)}), medians over the repeats; "
             f"tau ({modes[0]}) in parentheses; **best fixed**: the best fixed budget of the row, chosen after the run "
             f"(the DDTree paper's view); † flagged (a busy machine, or repeats more than {100 * SPREAD_LIMIT:.0f}% "
             f"apart). Decode-only speedups, `hf` and the reasons are in `results/summary.md`.", "",
             "| set, T | ar tok/s | " + " | ".join(methods) + " | best fixed |", "|---|---:|" + "---:|" * (len(methods) + 1)]
    for dataset, temperature in dict.fromkeys((r["dataset"], r["temperature"]) for r in rows):
        def cell(method: str) -> str:
            found = [by.get((mode, dataset, temperature, method)) for mode in modes]
            if all(r is None for r in found):
                return "-"
            first = next(r for r in found if r is not None)
            return " / ".join(_show(r, decode=False) for r in found) + f" ({first['tau']:.2f})"

        ar = " / ".join("-" if (r := by.get((mode, dataset, temperature, "ar"))) is None else
                        f"{r['tokens_per_second']:.1f}" + (" †" if r.get("flagged") else "") for mode in modes)
        bests = " / ".join(_show(b, decode=False, label=str(b["budget"]) + ": ") if b else "-"
                           for b in (best.get((mode, dataset, temperature)) for mode in modes))
        lines.append(f"| {dataset}, {temperature:g} | {ar} | " + " | ".join(cell(m) for m in methods) + f" | {bests} |")
    return "\n".join(lines) + "\n"


README_BEGIN, README_END = "<!-- benchmark-results:begin -->", "<!-- benchmark-results:end -->"


def update_readme(path: Path, tables: str) -> None:
    """Replace what lies between the README's benchmark-results markers with `tables`."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--update-readme: cannot read {path} ({e.strerror or e})") from None
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1 or text.index(README_BEGIN) > text.index(README_END):
        raise ConfigError(f"--update-readme: {path} needs one line {README_BEGIN} and, after it, one line "
                          f"{README_END}, around the place for the tables")
    head, rest = text.split(README_BEGIN)
    _, tail = rest.split(README_END)
    path.write_text(f"{head}{README_BEGIN}\n{tables.rstrip()}\n{README_END}{tail}", encoding="utf-8")


def write_summaries(out: Path, rows: list[dict], env: dict) -> str:
    """summary.md (also returned, for printing), summary.tex and summary.json in OUT."""
    modes = "; ".join(f"{mode}: {dtype}" for mode, dtype in env["modes"].items())
    header = (f"target {env['target']}, drafter **{env['drafter']}**, {env['device']}, target modes ({modes}), "
              f"{machine_line(env)}, torch {env['torch']}, transformers {env['transformers']}")
    warning = ("\n> The drafter is UNTRAINED (random weights): tau is about 1 and speculative methods are slower "
               "than ar. These numbers measure overhead only, not what DFlash/DDTree achieve.\n"
               if env["drafter"] == "untrained" else "")
    flagged = [r for r in rows if r.get("flagged")]
    flags = ("\n## Flagged cells\n\nTheir figures may be the machine's rather than the method's (a busy machine or "
             "repeats that disagree): re-run on a quiet machine (a re-run times busy prompts again).\n\n" +
             "".join(f"- {r['mode']} {r['dataset']} T={r['temperature']:g} {r['method']}: {r['flagged']}\n"
                     for r in flagged)) if flagged else ""
    md = (f"# ddtree benchmark\n\n{header}\n{warning}\nspeedup = method tokens/s / ar tokens/s on the same prompts "
          f"in the same target mode, end to end (the clock runs from before the prefill) and decode only (the "
          f"tokens after the first over the time after it, as the DDTree reference times); medians over the "
          f"repeats, their range in parentheses; tau = tokens per target verify pass; stage columns in ms per "
          f"generated token.\n\n## Headline\n\n{headline(rows, env)}\n{flags}\n"
          f"## A step's cost (ms a decoding step)\n\n{step_costs(rows)}\n## All rows\n\n"
          f"| {' | '.join(COLUMNS)} |\n|{'---|' * len(COLUMNS)}\n" +
          "".join(f"| {' | '.join(_cells(r))} |\n" for r in rows))
    (out / "summary.md").write_text(md)

    def tex(cell: str) -> str:
        for char in "_%#&":
            cell = cell.replace(char, "\\" + char)
        return cell.replace("x (", "$\\times$ (") if "x (" in cell else (
            cell[:-1] + "$\\times$" if cell.endswith("x") and cell[:-1].replace(".", "").isdigit() else cell)

    latex = ("% ddtree benchmark: " + header.replace("**", "") + "\n\\begin{tabular}{llrl" + "r" * (len(COLUMNS) - 5) +
             "l}\n\\toprule\n" + " & ".join(tex(c) for c in COLUMNS) + " \\\\\n\\midrule\n" +
             "".join(" & ".join(tex(c) for c in _cells(r)) + " \\\\\n" for r in rows) +
             "\\bottomrule\n\\end{tabular}\n")
    (out / "summary.tex").write_text(latex)
    (out / "summary.json").write_text(json.dumps({"env": env, "rows": rows, "best_fixed": best_fixed(rows)},
                                                 indent=1) + "\n")
    return md


EXIT_LOSSLESS_FAILED, EXIT_BAD_INPUT, EXIT_CRASHED = 1, 2, 3  # the exit statuses besides 0


def main(argv=None) -> int:
    """Exit status: 0 ok; 1 a lossless check failed; 2 bad input (or the results folder in use); 3 a crash."""
    args = parse_args(argv)
    try:
        return _main(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\ninterrupted: the finished records are kept; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - told apart from a failed check by its status
        traceback.print_exc()
        print(f"\nthe benchmark crashed (exit status {EXIT_CRASHED}); finished records in {args.out} are kept and a "
              "re-run resumes", file=sys.stderr)
        return EXIT_CRASHED
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


MAX_ATTEMPTS = 2  # a prompt whose runs met a busy machine is timed once more (--no-retime: never)


class GroupState(NamedTuple):
    attempt: int  # the attempt its runs belong to: the latest one, or a new one when that one is done and busy
    repeats: list[int]  # the repeats still to run in that attempt
    busy: bool  # a run of its latest attempt met a busy machine


def group_state(group: dict, runs: dict, repeats: int, attempts: int) -> GroupState:
    """What a prompt group still needs: the repeats its latest attempt lacks; or, when that attempt is complete
    but met a busy machine (other processes above LOAD_LIMIT cores) and fewer than `attempts` were made, a new
    attempt. A group with a failed lossless check is never timed again: that must not replace the failure."""
    latest = max((max(runs[s["key"]]) for s in group["slots"] if s["key"] in runs), default=1)
    mine = [runs.get(s["key"], {}).get(latest, {}) for s in group["slots"]]
    lacking = sorted({i for i in range(repeats) for have in mine if i not in have})
    lines = [line for have in mine for line in have.values()]
    busy = any((t["load"] or 0.0) > LOAD_LIMIT for line in lines for t in timings(line))
    if lacking or not busy or latest >= attempts or any(line["check"] == "error" for line in lines):
        return GroupState(latest, lacking, busy)
    return GroupState(latest + 1, list(range(repeats)), busy)


def _main(args) -> int:
    from tqdm import tqdm

    rank, world = init_distributed(args)
    busy = busy_cores(0.5)
    if not args.threads:  # else DDTREE_THREADS, else the cores other processes leave free, shared by the processes
        args.threads = LoadOptions.resolve().threads or default_threads(world, busy)
    if busy is not None and busy > LOAD_LIMIT and rank == 0:
        say(f"other processes keep {busy:.1f} cores busy: {args.threads} thread(s) per process; runs that meet a "
            "busy machine are timed again once and flagged if still busy")
    out = output_dir(args.out, "--out")
    specs = available(parse_methods(args.methods, args.budgets))  # llamacpp without llama-cpp-python: skipped, said
    modes = target_modes(args.quant, args)
    with build_lock(out / ".benchmark.lock", f"the results folder {out}", wait=False) if rank == 0 else nullcontext():
        return _run(args, rank, world, out, specs, modes, tqdm)


def write_results(args, out: Path, plan: list[dict], specs, envs: dict) -> tuple[list[dict], list[dict], dict, str]:
    """The summaries and last_run.json of the plan's records found in OUT: (those records, the rows, the
    environment, summary.md's text)."""
    records = load_records(out)
    planned = [records[s["key"]] for g in plan for s in g["slots"] if s["key"] in records]
    rows = summarize(planned, specs)
    env = dict(next(iter(envs.values())), modes={mode: e["dtype"] for mode, e in envs.items()}, repeats=args.repeats)
    text = write_summaries(out, rows, env)
    (out / "last_run.json").write_text(json.dumps({"keys": [r["key"] for r in planned], "env": env,
                                                   "args": vars(args)}, indent=1, default=str) + "\n")
    return planned, rows, env, text


@contextmanager
def _summary_if_failed(args, out: Path, plan: list[dict], specs, envs: dict, rank: int):
    """When the runs fail part way (an error, not an interrupt), rank 0 still writes the summaries of the records
    finished so far, then the error goes on."""
    try:
        yield
    except Exception:
        if rank == 0:
            try:
                records = load_records(out)
                if any(s["key"] in records for g in plan for s in g["slots"]):
                    planned = write_results(args, out, plan, specs, envs)[0]
                    say(f"the runs failed part way: {out}/summary.md summarizes the {len(planned)} finished "
                        "record(s)")
            except Exception as e:  # noqa: BLE001 - never hide the failure itself
                say(f"(no summary of the finished records: {type(e).__name__}: {e})")
        raise


def _run(args, rank, world, out, specs, modes, tqdm) -> int:
    if rank != 0:
        barrier(world)  # rank 0 loads first: the first load converts the GGUF into the shared cache
    pairs = {}  # target mode -> its pair; every mode is loaded up front, so its prompts interleave with the others'
    for mode in modes:
        # the CLI's load arguments (load sets torch's threads to args.threads), with this mode's quant
        pairs[mode] = api.load(**dict(load_options_from(args), quant=None if mode == "float" else mode))
        pairs[mode].decoder.sync_stages = args.sync_stages
    if rank == 0:
        barrier(world)
    envs = {mode: environment(pair, args.threads, world) for mode, pair in pairs.items()}
    # group i of every mode (the same prompt and setting) back to back: machine drift hits the modes alike
    plan = [g for same in zip(*(build_plan(args, pair, specs, mode) for mode, pair in pairs.items())) for g in same]
    runs = load_runs(out)
    mine = plan[rank::world]  # round-robin over groups: every rank gets a mix of datasets and prompts
    attempts = 1 if args.no_retime else MAX_ATTEMPTS
    needs = {id(g): group_state(g, runs, args.repeats, attempts) for g in mine}
    todo = [g for g in mine if needs[id(g)].repeats]
    count = lambda groups: sum(len(g["slots"]) * len(needs[id(g)].repeats) for g in groups)  # noqa: E731
    if rank == 0:
        print(f"ddtree benchmark: {len(plan)} prompt groups x {len(specs)} methods x {args.repeats} repeats "
              f"({', '.join(modes)}); drafter: {drafter_label(pairs[modes[0]])}; {world} process(es); "
              f"{count(todo)} runs to do on rank 0, {len(mine) - len(todo)} groups cached", file=sys.stderr)
    errors = 0
    suffix = "" if world == 1 else f".rank{rank}"
    shard, trace_shard = out / f"records{suffix}.jsonl", out / f"traces{suffix}.jsonl"
    progress = tqdm(total=count(todo), desc=f"rank {rank}", unit="run", position=rank, disable=args.no_progress,
                    dynamic_ncols=True)
    peers = {mode: Peers(pair) for mode, pair in pairs.items()}  # a peer runs each mode's idea of its weights
    meter = LoadMeter(expected=(world - 1) * args.threads)  # sibling ranks are expected load, not noise
    started = time.perf_counter()
    warm = []  # warm-up: first-call costs (allocator, lazy init, the adaptive budget's cost curve) stay out
    for mode in dict.fromkeys(g["mode"] for g in todo):
        group = next(g for g in todo if g["mode"] == mode)
        warm += [dict(r, mode=mode) for r in run_prompt(pairs[mode], group["prompt"], specs, RunSettings(
            WARMUP_TOKENS, block_size=args.block_size, stop=group["stop"]), peers=peers[mode])]
    if todo and rank == 0:
        say(f"estimated time for the {progress.total} runs: {_minutes(estimate_seconds(warm, todo, args))} "
            f"(from the warm-up's {WARMUP_TOKENS}-token runs; re-estimated after the first prompt)")
    inject = [True] if args.inject_mismatch else []  # consumed by the first ddtree run
    with open(shard, "a", encoding="utf-8") as sink, open(trace_shard, "a", encoding="utf-8") as traces, \
            _summary_if_failed(args, out, plan, specs, envs, rank):
        for path, f in ((shard, sink), (trace_shard, traces)):
            if f.tell() and not path.read_bytes().endswith(b"\n"):
                f.write("\n")  # a crash cut the last line short: never glue a new record onto it
        sinks = {"records": sink, "traces": traces}
        first = next((i for i, g in enumerate(todo) if _prompt_of(g) != _prompt_of(todo[0])), len(todo))
        measured, t0 = [], time.perf_counter()  # the first prompt's runs, in every mode (adjacent in the plan)
        for attempt in range(attempts):
            if attempt:  # the groups whose runs met a busy machine, once more
                needs = {id(g): group_state(g, runs, args.repeats, attempts) for g in mine}
                todo = [g for g in mine if needs[id(g)].repeats]
                if not todo:
                    break
                if rank == 0:
                    say(f"timing {len(todo)} prompt group(s) again: other processes used more than {LOAD_LIMIT} "
                        f"cores during some of their runs")
                progress.reset(total=count(todo))
            for repeat in range(args.repeats):  # a pass over the plan per repeat
                for i, group in enumerate(todo):
                    state = needs[id(group)]
                    if repeat not in state.repeats:
                        continue
                    recs = run_group(pairs[group["mode"]], group, args, envs[group["mode"]], sinks, progress, inject,
                                     peers[group["mode"]], meter, state.attempt, repeat)
                    for rec in recs:
                        runs.setdefault(rec["key"], {}).setdefault(state.attempt, {})[repeat] = rec
                    errors += sum(r["check"] == "error" for r in recs)
                    if attempt or repeat != state.repeats[0]:
                        continue
                    measured += recs if i < first else []
                    if i == first - 1 and rank == 0 and len(todo) > first:
                        scale = (time.perf_counter() - t0) / max(1e-9, estimate_seconds(measured, todo[:first], args,
                                                                                         repeats=1))
                        left = (estimate_seconds(measured, todo, args) - estimate_seconds(
                            measured, todo[:first], args, repeats=1)) * scale  # the checks and the rest
                        say(f"estimated total: {_minutes(time.perf_counter() - started + left)} (from the first "
                            f"prompt's runs at up to {args.max_new_tokens} tokens each; runs that stop at EOS are "
                            f"shorter)")
    if trace_shard.stat().st_size == 0:
        trace_shard.unlink()
    progress.close()
    barrier(world)
    if rank != 0:
        return EXIT_LOSSLESS_FAILED if errors else 0
    if world > 1:
        merge_shards(out)
    planned, rows, env, text = write_results(args, out, plan, specs, envs)
    print(text)
    if args.update_readme:
        update_readme(Path(args.update_readme), readme_table(rows, env))
        say(f"wrote this run's tables into {args.update_readme}")
    total_errors = sum(r["errors"] for r in rows)  # cached errors count too: resuming never hides a failure
    if total_errors:
        print(f"\nFAILED: {total_errors} lossless check error(s); see the lines marked LOSSLESS CHECK FAILED "
              f"and the check_detail fields in {out}/records.jsonl", file=sys.stderr)
        for rec in planned:
            if rec["check"] == "error":
                shout_error(rec)
        return EXIT_LOSSLESS_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
