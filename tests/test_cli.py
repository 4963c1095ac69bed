"""The command lines' bad input (ddtree/cli.py, the benchmark, the training CLI, the plots): one table, each
refused with exit status 2 and a message that names the fix."""
import json
import re
from pathlib import Path

import pytest
import torch


def test_cli_reports_config_errors(capsys):
    from ddtree.cli import main

    assert main(["generate", "hi", "--target", "/nonexistent/model"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["compare", "hi", "--target", "/nonexistent/model"]) == 2


def _plots_main(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_results", Path(__file__).resolve().parent.parent /
                                                  "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _entry(name):
    from ddtree import benchmark, cli
    from ddtree.train import cli as train_cli

    return {"ddtree": cli.main, "train": train_cli.main, "benchmark": benchmark.main, "plots": _plots_main}[name]


CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


CLI_CASES = [  # (entry, argv, message); {file} is a plain file, {dir} an empty directory, the rest see cli_files
    ("benchmark", ["--threads", "-1"], "argument --threads: must be >= 1, got -1"),
    ("benchmark", ["--num-prompts", "0"], "argument --num-prompts: must be >= 1"),
    ("benchmark", ["--tiny", "--out", "{file}", "--target", "/nonexistent"], "--out {file} is a file"),
    ("plots", ["--results", "{results}", "--out", "{file}"], "--out {file} is a file"),
    ("train", ["fit", "--data", "{dir}", "--out", "{file}"], "--out {file} is a file"),
    ("train", ["fit", "--data", "{bad_shard}", "--out", "{dir}"],
     "shard_00000.jsonl:2: not valid JSON .*delete it and rerun the same generate-data command"),
    ("train", ["fit", "--data", "{bad_chunk}", "--out", "{dir}"],
     "chunk_00000.npz is damaged .*delete it and rerun the same generate-data command"),
    ("train", ["generate-data", "--out", "{file}"], "--out {file} is a file"),
    ("train", ["generate-data", "--out", "{dir}", "--num-prompts", "0"], "argument --num-prompts: must be >= 1"),
    ("train", ["generate-data", "--out", "{dir}", "--threads", "-1"], "argument --threads: must be >= 1"),
    ("train", ["generate-data", "--out", "{dir}", "--prompts-file", "{bench_prompts}", "--target", "/nonexistent"],
     r"bench.jsonl:1: expected a non-empty .*, got \['turns'\] \(that is the benchmark's format\)"),
    ("train", ["generate-data", "--out", "{dir}", "--prompts-file", "{bad_json}", "--target", "/nonexistent"],
     "bad.jsonl:2: not valid JSON"),
    ("train", ["generate-data", "--out", "{dir}", "--prompts-file", "{file}"],
     "--prompts-file {file} holds no prompts"),
    ("train", ["export", "--run", "{bad_json}", "--out", "{dir}/x"], "bad.jsonl is not a training checkpoint"),
    ("train", ["export", "--run", "{dir}", "--out", "{dir}/x"], "no checkpoint at"),
    ("ddtree", ["generate", "hi", "--dtype", "int8", "--target", "/nonexistent"], "unknown dtype 'int8'"),
    pytest.param("ddtree", ["generate", "hi", "--device", "cuda", "--target", "/nonexistent"],
                 "device 'cuda' is not available", marks=CUDA),
    pytest.param("train", ["fit", "--data", "{data}", "--out", "{dir}", "--device", "cuda", "--target", "/nonexistent"],
                 "device 'cuda' is not available", marks=CUDA),
]


@pytest.fixture
def cli_files(tmp_path):
    paths = {"file": tmp_path / "a-file", "dir": tmp_path / "empty", "results": tmp_path / "results",
             "bench_prompts": tmp_path / "bench.jsonl", "bad_json": tmp_path / "bad.jsonl",
             "bad_shard": tmp_path / "shards", "data": tmp_path / "data", "bad_chunk": tmp_path / "chunks"}
    paths["file"].write_text("")
    paths["dir"].mkdir()
    paths["results"].mkdir()
    (paths["results"] / "records.jsonl").write_text(json.dumps({"key": "k"}) + "\n")
    paths["bench_prompts"].write_text(json.dumps({"turns": ["Hello?"]}) + "\n")
    paths["bad_json"].write_text(json.dumps({"text": "ok"}) + "\n{'text': 'single quotes'}\n")
    for name, second in (("bad_shard", "{not json\n"), ("data", "")):
        paths[name].mkdir()
        record = {"key": "k", "source": "s", "split": "train", "prompt_ids": [1], "response_ids": [2, 3]}
        (paths[name] / "shard_00000.jsonl").write_text(json.dumps(record) + "\n" + second)
    paths["bad_chunk"].mkdir()
    (paths["bad_chunk"] / "chunk_00000.npz").write_bytes(b"PK\x03\x04 cut short")
    return {k: str(v) for k, v in paths.items()}


@pytest.mark.parametrize("entry,argv,message", CLI_CASES)
def test_cli_bad_input(entry, argv, message, cli_files, capsys):
    argv = [a.format(**cli_files) for a in argv]
    try:
        code = _entry(entry)(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and re.search(message.format(**cli_files), err), err
    assert "Traceback" not in err
