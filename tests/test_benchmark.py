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
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    proc = run("bash", "run_benchmark.sh", "--tiny", "--threads", "1", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "estimated time for the 18 runs: ~" in proc.stderr and "estimated total: ~" in proc.stderr
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
        assert r["check"] in ({"reference"} if r["method"] == "ar" else {"identical", "tie_flip"})
        assert r["env"]["torch"] and r["env"]["dtype"] and r["env"]["drafter"]
    summary = (tiny_results / "summary.md").read_text()
    assert "| humaneval | 0 | ddtree:16 |" in summary and "drafter" in summary
    assert (tiny_results / "summary.tex").read_text().count("\\\\") >= 10  # header + 9 rows
    rows = json.loads((tiny_results / "summary.json").read_text())["rows"]
    assert len(rows) == 9 and all(r["errors"] == 0 for r in rows)
    assert all(abs(r["speedup"] - 1.0) < 1e-9 for r in rows if r["method"] == "ar")


def test_rerun_reuses_cached_records(tiny_results):
    before = (tiny_results / "records.jsonl").read_text()
    proc = run(sys.executable, "-m", "ddtree.benchmark", "--tiny", "--threads", "1", "--no-progress",
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
    row = next(line for line in (tmp_path / "summary.md").read_text().splitlines() if "| ddtree:16 |" in line)
    assert row.endswith("| 1 |")  # the errors column


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
    steps = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    for r in recs:
        if r["method"] == "hf":
            continue
        mine = [s for s in steps if s["key"] == r["key"]]
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
    assert "estimated time for the 6 runs: ~" in proc.stderr
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
    from ddtree.benchmark import parse_args, target_modes

    assert parse_args([]).quant == "auto" and parse_args(["--tiny"]).quant == "float"
    cpu = parse_args(["--device", "cpu"])
    assert target_modes("auto", cpu) == ["float", "gguf-int8"]
    assert target_modes("auto", parse_args(["--device", "cpu", "--cpu-kernel", "off"])) == ["float"]
    assert target_modes("auto", parse_args(["--device", "cpu", "--dtype", "bfloat16"])) == ["float"]
    assert target_modes("gguf-int8,float", cpu) == ["gguf-int8", "float"]
