"""End to end: run_benchmark.sh --tiny with the real embedded SmolLM2 target, the plots, and the checker
self-test (--inject-mismatch must fail the run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.real_model

METHODS = {"ar", "dflash", "ddtree:16"}


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # One thread: the tiny run is dominated by per-op overhead, and test machines are often shared.
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def records(out: Path) -> list[dict]:
    """The folder's records, one per key (a prompt timed again on a busy machine has a later line per method)."""
    from ddtree.bench.benchmark import load_records

    return list(load_records(out).values())


def traces_of(out: Path) -> dict[str, list[dict]]:
    """The folder's traces by key: each record's own run's steps."""
    from ddtree.bench.benchmark import load_traces

    return load_traces(out)


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    proc = run("bash", "run_benchmark.sh", "--tiny", "--threads", "1", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "estimated time for the 36 runs: ~" in proc.stderr and "estimated total: ~" in proc.stderr  # 2 repeats
    return out


def test_tiny_benchmark_records(tiny_results):
    recs = records(tiny_results)
    # --tiny: 3 datasets x 2 prompts x T=0 x (ar, dflash, ddtree:16)
    assert len(recs) == 18
    assert {r["dataset"] for r in recs} == {"humaneval", "mt-bench", "gsm"}
    assert {r["method"] for r in recs} == METHODS
    assert {r["prompt_index"] for r in recs} == {0, 1}
    for r in recs:
        assert r["new_tokens"] == len(r["token_ids"]) and 0 < r["new_tokens"] <= 8
        assert r["seconds"] > 0 and r["steps"] >= 1
        # --tiny times every run twice; the record's times are the medians of its repeats
        assert len(r["repeats"]) == 2 and r["attempt"] in (1, 2) and not r.get("repeats_differ")
        assert r["seconds"] == pytest.approx(sum(t["seconds"] for t in r["repeats"]) / 2)
        assert 0 < r["time_to_first_token"] < r["seconds"] and r["decode_seconds"] > 0
        assert r["check"] in ({"reference"} if r["method"] == "ar" else {"identical", "tie_flip"})
        assert r["env"]["torch"] and r["env"]["dtype"] and r["env"]["drafter"]
    summary = (tiny_results / "summary.md").read_text()
    assert "| humaneval | 0 | ddtree:16 |" in summary and "drafter" in summary
    assert (tiny_results / "summary.tex").read_text().count("\\\\") >= 10  # header + 9 rows
    summary_json = json.loads((tiny_results / "summary.json").read_text())
    rows = summary_json["rows"]
    assert len(rows) == 9 and all(r["errors"] == 0 for r in rows)
    assert all(abs(r["speedup"] - 1.0) < 1e-9 for r in rows if r["method"] == "ar")
    for r in rows:  # medians with their range, end to end and decode only, and a flag (None or its reason)
        assert r["repeats"] == 2 and r["speedup_range"][0] <= r["speedup"] <= r["speedup_range"][1]
        assert r["decode_speedup_range"][0] <= r["decode_speedup"] <= r["decode_speedup_range"][1]
        assert "flagged" in r and (r["flagged"] is None or "repeats" in r["flagged"] or "cores" in r["flagged"])
    assert [b["method"] for b in summary_json["best_fixed"]] == ["ddtree:16"] * 3  # the only fixed budget
    assert "## Headline" in summary and "| set, T | ar tok/s | dflash | ddtree:16 | best fixed |" in summary
    # a step's cost: ar's step and verify, and each speculative method's draft and verify against them
    assert "## A step's cost" in summary and "| humaneval, 0 | ar | 1.0 | 1.00 |" in summary
    assert all(r["stage_ms_per_step"]["verify"] > 0 and r["ms_per_step"] >= r["stage_ms_per_step"]["verify"]
               for r in rows)
    assert "AVX" in summary_json["env"]["cpu"] and "cores" in summary_json["env"]["cpu"]


def test_rerun_reuses_cached_records(tiny_results):
    before = (tiny_results / "records.jsonl").read_text()
    proc = run(sys.executable, "-m", "ddtree.bench.benchmark", "--tiny", "--threads", "1", "--no-progress",
               "--out", str(tiny_results))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "6 groups cached" in proc.stderr
    assert (tiny_results / "records.jsonl").read_text() == before  # nothing re-run, nothing appended


def test_plots(tiny_results):
    proc = run(sys.executable, "plot_results.py", "--results", str(tiny_results))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("speedup_vs_budget", "tau_vs_budget", "acceptance_hist", "stage_time"):
        for ext in ("png", "pdf"):
            path = tiny_results / "plots" / f"{name}.{ext}"
            assert path.is_file() and path.stat().st_size > 5000, path


def test_injected_mismatch_fails(tmp_path):
    proc = run("bash", "run_benchmark.sh", "--tiny", "--datasets", "gsm", "--num-prompts", "1", "--threads", "1",
               "--no-progress", "--inject-mismatch", "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LOSSLESS CHECK FAILED" in proc.stderr and "ddtree:16" in proc.stderr
    bad = [r for r in records(tmp_path) if r["check"] == "error"]
    assert len(bad) == 1 and bad[0]["method"] == "ddtree:16" and "injected_mismatch_at" in bad[0]
    from ddtree.bench.benchmark import COLUMNS

    row = next(line for line in (tmp_path / "summary.md").read_text().splitlines()
               if line.startswith("| float | gsm | 0 | ddtree:16 |"))
    assert row.split(" | ")[COLUMNS.index("errors")] == "1"  # the errors column


def test_hf_baseline_adaptive_budget_and_traces(tmp_path):
    """`hf` (HF generate() on the same weights, greedy only) and `ddtree:auto` run, check and plot like the rest;
    --traces writes one line per decoding step and the trace plots."""
    proc = run("bash", "run_benchmark.sh", "--tiny", "--datasets", "gsm", "--num-prompts", "1", "--temperatures",
               "0,1", "--methods", "ar,hf,dflash,ddtree", "--budgets", "16,auto", "--threads", "1", "--no-progress",
               "--traces", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = records(tmp_path)
    by = {(r["method"], r["temperature"]): r for r in recs}
    assert set(by) == {(m, t) for m in ("ar", "dflash", "ddtree:16", "ddtree:auto") for t in (0, 1)} | {("hf", 0)}
    assert by[("hf", 0)]["check"] in ("identical", "tie_flip") and by[("hf", 0)]["seconds"] > 0
    auto = by[("ddtree:auto", 0)]
    assert auto["check"] in ("identical", "tie_flip") and auto["budget"] == "auto"
    assert len(auto["tree_sizes"]) == auto["steps"] and 1 <= max(auto["tree_sizes"]) <= 257
    traces = traces_of(tmp_path)
    for r in recs:
        if r["method"] == "hf":
            continue
        mine = traces[r["key"]]
        assert len(mine) == r["steps"] and [len(s["accepted"]) for s in mine] == r["acceptance_lengths"], r["method"]
        assert all(len(s["tokens"]) == len(s["parents"]) == len(s["draft_logprobs"]) for s in mine)
    proc = run(sys.executable, "plot_results.py", "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("speedup_vs_budget", "trace_depth", "trace_rank", "trace_calibration"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 5000, name


def test_two_target_modes(tmp_path):
    """--quant float,gguf-int8: every method in both target modes, each checked against its own mode's ar; the
    summary has each mode's rows together, and the plots a row of panels per mode."""
    proc = run("bash", "run_benchmark.sh", "--tiny", "--quant", "float,gguf-int8", "--datasets", "gsm",
               "--num-prompts", "1", "--threads", "1", "--no-progress", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "estimated time for the 12 runs: ~" in proc.stderr
    recs = records(tmp_path)
    assert sorted((r["mode"], r["method"]) for r in recs) == sorted(
        (mode, method) for mode in ("float", "gguf-int8") for method in METHODS)
    for r in recs:
        assert r["check"] in ({"reference"} if r["method"] == "ar" else {"identical", "tie_flip"})
        assert r["env"]["dtype"].endswith(" int8") == (r["mode"] == "gguf-int8")
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["float"] * 3 + ["gguf-int8"] * 3
    summary = (tmp_path / "summary.md").read_text()
    assert "| gguf-int8 | gsm | 0 | ddtree:16 |" in summary and "gguf-int8: float32 gguf" in summary
    proc = run(sys.executable, "plot_results.py", "--results", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "plots" / "speedup_vs_budget.png").stat().st_size > 5000


def test_target_modes_auto():
    """auto: the float target, plus integer activations where they run (a CPU, a GGUF target, the CPU kernels)."""
    from ddtree.bench.benchmark import parse_args, target_modes

    assert parse_args([]).quant == "auto" and parse_args(["--tiny"]).quant == "float"
    cpu = parse_args(["--device", "cpu"])
    assert target_modes("auto", cpu) == ["float", "gguf-int8"]
    assert target_modes("auto", parse_args(["--device", "cpu", "--cpu-kernel", "off"])) == ["float"]
    assert target_modes("auto", parse_args(["--device", "cpu", "--dtype", "bfloat16"])) == ["float"]
    assert target_modes("gguf-int8,float", cpu) == ["gguf-int8", "float"]


@pytest.fixture
def in_process(monkeypatch):
    """benchmark.main in this process (so a test can stand in for the machine's load); torch's thread count put
    back afterwards."""
    import torch

    from ddtree.bench import benchmark

    threads = torch.get_num_threads()
    monkeypatch.setattr(benchmark, "busy_cores", lambda seconds=0.5: 0.0)
    yield benchmark
    torch.set_num_threads(threads)


TINY_ONE = ["--tiny", "--datasets", "gsm", "--num-prompts", "1", "--methods", "ar,ddtree", "--budgets", "2",
            "--max-new-tokens", "4", "--no-progress"]


def test_runs_on_a_busy_machine_are_timed_again_once_then_flagged(in_process, tmp_path, monkeypatch, capsys):
    """Every run meets a busy machine (one other core in use): the prompt is timed a second time at the end, and
    the cells stay flagged with the reason, in summary.md, summary.json and the plots."""
    monkeypatch.setattr(in_process.LoadMeter, "lap", lambda self: 1.0)
    monkeypatch.setattr(in_process, "busy_cores", lambda seconds=0.5: 1.0)
    assert in_process.main(TINY_ONE + ["--traces", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "other processes keep 1.0 cores busy" in err and "timing 1 prompt group(s) again" in err
    # each attempt writes its trees; a record's are its latest attempt's (an adaptive budget's trees can differ)
    traced = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert sorted({s["attempt"] for s in traced}) == [1, 2]
    latest = traces_of(tmp_path)
    assert all(s["attempt"] == 2 for steps in latest.values() for s in steps)
    assert {r["key"]: r["steps"] for r in records(tmp_path)} == {key: len(steps) for key, steps in latest.items()}
    lines = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]  # one per run
    assert sorted((r["method"], r["attempt"], r["repeat"]) for r in lines) == [
        (method, attempt, repeat) for method in ("ar", "ddtree:2") for attempt in (1, 2) for repeat in (0, 1)]
    assert all(r["load"] == 1.0 for r in lines)
    assert [r["attempt"] for r in records(tmp_path)] == [2, 2]  # a record is its latest attempt's runs
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["env"]["threads"] == 1  # cores left free by the busy one
    # the load's reason first; a 4-token run's time may also vary past the spread limit on a shared test machine,
    # which adds its own reason after it
    load = "other processes used 1.00 cores during a run (limit 0.25)"
    assert [r["flagged"].split("; ")[0] for r in summary["rows"]] == [load] * 2
    assert "## Flagged cells" in (tmp_path / "summary.md").read_text()
    # a re-run: attempts are used up, so nothing is timed again
    assert in_process.main(TINY_ONE + ["--traces", "--out", str(tmp_path)]) == 0
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 8
    # --no-retime: measured once, flagged
    assert in_process.main(TINY_ONE + ["--no-retime", "--out", str(tmp_path / "once")]) == 0
    once = [json.loads(line) for line in (tmp_path / "once" / "records.jsonl").read_text().splitlines()]
    assert [r["attempt"] for r in once] == [1, 1, 1, 1]


def test_a_quiet_machine_is_measured_once_and_not_flagged(in_process, tmp_path, monkeypatch):
    monkeypatch.setattr(in_process.LoadMeter, "lap", lambda self: 0.0)
    assert in_process.main(TINY_ONE + ["--repeats", "3", "--out", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    # the repeats are passes over the plan: ar and ddtree:2 of repeat 0, then of repeat 1, ...
    assert [(r["method"], r["attempt"], r["repeat"]) for r in lines] == [
        (method, 1, repeat) for repeat in range(3) for method in ("ar", "ddtree:2")]
    assert [len(r["repeats"]) for r in records(tmp_path)] == [3, 3]
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    # a 4-token run's time can still vary by more than the spread limit on a shared test machine: only the
    # load must not flag here
    assert all(r["flagged"] is None or "cores" not in r["flagged"] for r in rows)


def test_one_writer_per_results_folder(in_process, tmp_path, capsys):
    """A second benchmark on the same --out is refused up front (exit 2), naming the running one."""
    import os
    import socket

    (tmp_path / ".benchmark.lock").write_text(f"{socket.gethostname()} {os.getppid()}\n")  # a live process
    assert in_process.main(TINY_ONE + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is in use by process" in err and str(os.getppid()) in err
    assert not (tmp_path / "records.jsonl").exists()


def test_an_interrupted_run_resumes_at_the_missing_repeats(in_process, tmp_path, monkeypatch):
    """Runs are stored one by one: a run stopped after some repeats does only the rest when started again."""
    monkeypatch.setattr(in_process.LoadMeter, "lap", lambda self: 0.0)
    assert in_process.main(TINY_ONE + ["--repeats", "3", "--out", str(tmp_path)]) == 0
    path = tmp_path / "records.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # repeat 1 of ddtree:2 torn, repeat 2 lost
    assert in_process.main(TINY_ONE + ["--repeats", "3", "--out", str(tmp_path)]) == 0
    again = [json.loads(line) for line in path.read_text().splitlines()[4:]]
    assert [(r["method"], r["repeat"]) for r in again] == [("ar", 1), ("ddtree:2", 1), ("ar", 2), ("ddtree:2", 2)]
    assert [len(r["repeats"]) for r in records(tmp_path)] == [3, 3]


def test_records_of_other_code_are_measured_again(in_process, tmp_path, monkeypatch, capsys):
    """A re-run resumes only a run of the same code: after a change to the package or the kernels (or on another
    machine), the cached records are not reused, so the README's table never pairs old numbers with a new commit."""
    import shutil

    monkeypatch.setattr(in_process.LoadMeter, "lap", lambda self: 0.0)
    kernels = tmp_path / "kernels"
    shutil.copytree(in_process.kernel_dir(), kernels)
    monkeypatch.setattr(in_process, "kernel_dir", lambda: kernels)
    out = tmp_path / "out"
    assert in_process.main(TINY_ONE + ["--out", str(out)]) == 0
    assert in_process.main(TINY_ONE + ["--out", str(out)]) == 0
    assert "1 groups cached" in capsys.readouterr().err  # the same code: reused
    (kernels / "tree.cpp").write_text((kernels / "tree.cpp").read_text() + "\n// a change\n")
    assert in_process.main(TINY_ONE + ["--out", str(out)]) == 0
    assert "0 groups cached" in capsys.readouterr().err
    assert len((out / "records.jsonl").read_text().splitlines()) == 2 * 2 * 2  # 2 methods x 2 repeats, twice


def test_a_prompt_over_the_context_is_refused_before_any_decoding(in_process, tmp_path, capsys):
    """Issue 55: the over-long prompt on line 2 is named (file:line) when the plan is made, exit 2, nothing decoded;
    before, prompt 1 ran first and the run that reached line 2 failed without saying where it came from."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n" + json.dumps({"prompt": "hello " * 9000}) + "\n")
    out = tmp_path / "out"
    assert in_process.main(TINY_ONE + ["--datasets", str(prompts), "--num-prompts", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}:2: the prompt has" in err and "more than the target's context limit of" in err
    assert not (out / "records.jsonl").exists()


def test_a_run_that_fails_part_way_summarizes_the_finished_records(in_process, tmp_path, monkeypatch, capsys):
    """Issue 55: the second prompt's runs crash (exit 3); the first prompt's records still get summary.md/.json."""
    monkeypatch.setattr(in_process.LoadMeter, "lap", lambda self: 0.0)
    real, calls = in_process.run_group, []

    def run_group(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kw)

    monkeypatch.setattr(in_process, "run_group", run_group)
    assert in_process.main(TINY_ONE + ["--num-prompts", "2", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "RuntimeError: boom" in err and "summarizes the 2 finished record(s)" in err
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [(r["method"], r["prompts"]) for r in rows] == [("ar", 1), ("ddtree:2", 1)]
    assert len(json.loads((tmp_path / "last_run.json").read_text())["keys"]) == 2


@pytest.mark.parametrize("nproc", ["abc", "0", "2x"])
def test_run_benchmark_sh_refuses_a_bad_nproc(nproc):
    """Issue 55: `NPROC=abc bash run_benchmark.sh` said `integer expression expected` (a shell error) after the
    install checks; now a clear message and exit 2, before anything else."""
    proc = subprocess.run(["bash", "run_benchmark.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NPROC": nproc}, timeout=60)
    assert proc.returncode == 2 and f"NPROC must be a positive integer (the number of processes), got '{nproc}'" \
        in proc.stderr and not proc.stdout
