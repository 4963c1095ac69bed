"""plot_results.py's reading of a results folder: a damaged or stale last_run.json is refused with the fix."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("plot_results", ROOT / "plot_results.py")
plot_results = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_results)


def folder(tmp_path: Path, last_run: str) -> Path:
    (tmp_path / "records.jsonl").write_text(json.dumps({"key": "k1", "method": "ar"}) + "\n")
    (tmp_path / "last_run.json").write_text(last_run)
    return tmp_path


def test_a_damaged_last_run_is_refused_with_the_fix(tmp_path, capsys):
    assert plot_results.main(["--results", str(folder(tmp_path, '{"keys": [tr'))]) == 2
    err = capsys.readouterr().err
    assert "last_run.json is damaged" in err and "--all" in err and "Traceback" not in err


def test_a_stale_last_run_says_what_the_folder_holds(tmp_path, capsys):
    """last_run.json names records that are gone: not "no records", but how many there are and what to do."""
    assert plot_results.main(["--results", str(folder(tmp_path, json.dumps({"keys": ["gone"], "env": {}})))]) == 2
    err = capsys.readouterr().err
    assert "holds 1 records, but none of the last run's" in err and "--all" in err
