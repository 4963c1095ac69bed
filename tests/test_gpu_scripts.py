"""The GPU window scripts' dry runs (SMOKE=1: the whole last device call on this CPU, tiny settings), so that a
script a GPU session depends on cannot break unseen between the sessions that have a GPU: scripts/gpu_data_run.sh
(with scripts/gpu_self_check.py, the check it makes before generating) and scripts/gpu_train_run.sh."""
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _smoke(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, run = tmp_path / "out", tmp_path / "run"
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "RUN_DIR": str(run)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, out, run


@pytest.mark.slow
def test_the_data_window_dry_run_checks_the_fast_paths_and_packs_its_chunks(tmp_path):
    done, out, run = _smoke("gpu_data_run.sh", tmp_path)
    assert "fast paths (graphs False, row attention) equal to the plain passes" in (out / "gpu-check.txt").read_text()
    chunks = sorted((run / "smollm2-gpu1").glob("chunk_*.npz"))
    assert chunks and (out / "data.tar.xz.part00").stat().st_size > 0
    assert f"generated: {len(chunks)} chunks" in done.stdout


@pytest.mark.slow
def test_the_training_window_dry_run_trains_both_arms_and_packs_them(tmp_path):
    done, out, run = _smoke("gpu_train_run.sh", tmp_path)
    assert "calibrated:" in done.stdout and "trained; packing" in done.stdout
    assert "embedded pair (exit 0): best " in done.stdout and "verdicts ['identical']" in done.stdout
    assert json.loads((out / "gpu_e2e_embedded.json").read_text())["which"] == "embedded"
    for arm in ("all", "old"):
        assert f"{arm}: fit: done at step 3/3" in done.stdout
        assert (run / "pack" / arm / "manifest.json").is_file()
    assert sorted(p.name for p in out.glob("results.tar.xz.part*"))[0] == "results.tar.xz.part00"
    with tarfile.open(out / "logs.tgz") as logs:
        assert {"logs/driver.txt", "logs/fit-all.txt", "logs/fit-old.txt"} <= set(logs.getnames())


@pytest.mark.slow
def test_the_reference_comparison_dry_run_matches_the_references_trees_and_tokens(tmp_path):
    """scripts/gpu_reference.py on tiny shapes: the published DDTree code, on the same weights and oracle draws,
    accepts exactly this engine's paths (equal tau) and both decode `ar`'s tokens. It needs the reference's snapshot
    in .ref/ddtree (not shipped: its code is not ours), so it is skipped where there is none."""
    if not (ROOT / ".ref" / "ddtree" / "ddtree.py").is_file():
        pytest.skip("no snapshot of liranringel/ddtree in .ref/ddtree (scripts/gpu_reference.py says how to get one)")

    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path)}
    done = subprocess.run(["python", str(ROOT / "scripts" / "gpu_reference.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_reference.json").read_text())["rows"]
    assert [r["budget"] for r in rows] == [8, 16]
    for r in rows:
        assert r["ours_tau"] == r["ref_tau"] > 1.5 and r["ours_equal_ar"] and r["ref_equal_ar"], r
