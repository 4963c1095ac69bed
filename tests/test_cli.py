"""The command line (ddtree/cli.py): streaming (`generate --stream`), stops (`--stop`, `--stop-token-id`) and the
chat loop, on a seeded random target saved with a character tokenizer and a chat template (scripted input, no
terminal); and the command lines' bad input (the CLI, the benchmark, the training CLI, the plots) in one table,
each refused with exit status 2 and a message that names the fix."""
import io
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

import ddtree
from ddtree.cli import _unescape, main
from ddtree.testing import char_tokenizer, random_pair, save_target

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a: {% endif %}")


def save(directory, template: bool):
    target, _ = random_pair("llama", seed=11, init_scale=0.25)
    tok = char_tokenizer()
    if template:
        tok.chat_template = TEMPLATE
    return str(save_target(target, directory, tok))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("chat-model"), template=True)


@pytest.fixture(scope="module")
def pair(model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untrained drafter's warning
        return ddtree.load(target=model_dir, device="cpu", dtype="float32")


def cli(model_dir, *argv):
    return main([*argv, "--target", model_dir, "--device", "cpu", "--dtype", "float32"])


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
@pytest.mark.parametrize("method", ["ar", "ddtree:4"])
def test_generate_stream_prints_the_generated_text(model_dir, method, capsys):
    assert cli(model_dir, "generate", "Tell me a story", "--method", method, "--max-new-tokens", "24", "--json") == 0
    full = json.loads(capsys.readouterr().out)
    stop = full["text"][6:8]
    assert stop in full["text"]
    for extra, text in (([], full["text"]), ([f"--stop={stop}"], full["text"][:full["text"].find(stop)])):
        assert cli(model_dir, "generate", "Tell me a story", "--method", method, "--max-new-tokens", "24", "--stream",
                   *extra) == 0
        out, err = capsys.readouterr()
        assert out == text + "\n"
        assert f"stop: {f'stop_string {stop!r}' if extra else full['stats']['stop_reason']}," in err


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_stop_escapes_and_stop_token_ids(model_dir, capsys):
    assert cli(model_dir, "generate", "Tell me a story", "--max-new-tokens", "12", "--json") == 0
    full = json.loads(capsys.readouterr().out)
    stop_id = full["token_ids"][4]
    assert cli(model_dir, "generate", "Tell me a story", "--max-new-tokens", "12", "--json", "--stop", "~\\n",
               "--stop-token-id", str(stop_id)) == 0
    res = json.loads(capsys.readouterr().out)
    k = full["token_ids"].index(stop_id) + 1
    assert res["token_ids"] == full["token_ids"][:k] and res["stats"]["stop_reason"] == "stop_token"
    assert res["stats"]["stop_match"] == stop_id
    assert _unescape("a\\nb\\\\c\\td\\x") == "a\nb\\c\td\\x"


def test_bad_stream_and_stop_options_are_refused_before_loading(capsys):
    assert main(["generate", "hi", "--stream", "--json", "--target", "/nonexistent"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(["generate", "hi", "--stop", "", "--target", "/nonexistent"]) == 2
    assert "empty string" in capsys.readouterr().err


def chat(model_dir, monkeypatch, lines, *argv):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return cli(model_dir, "chat", "--max-new-tokens", "12", *argv)


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
@pytest.mark.parametrize("method", ["ar", "ddtree:auto"])
def test_chat_keeps_the_conversation_and_streams_each_answer(model_dir, pair, method, monkeypatch, capsys):
    assert chat(model_dir, monkeypatch, "Hi there\n\nHow are you\nexit\nnot read\n", "--method", method) == 0
    out, err = capsys.readouterr()
    first = pair.generate([{"role": "user", "content": "Hi there"}], method="ar", max_new_tokens=12).text
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "How are you"}]
    second = pair.generate(history, method="ar", max_new_tokens=12).text
    assert first != second  # the second answer saw the first turn: the history changes it
    assert out == f"> {first}\n> > {second}\n> "  # the empty line is skipped; "exit" ends before "not read"
    stats = [line for line in err.splitlines() if line.startswith(f"[{method}]")]
    assert len(stats) == 2 and all("tau " in s and " tok/s" in s for s in stats)


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_chat_ends_cleanly_on_end_of_input_and_ctrl_c(model_dir, monkeypatch, capsys):
    assert chat(model_dir, monkeypatch, "Hello") == 0  # no newline, then end of input
    out, _ = capsys.readouterr()
    assert out.startswith("> ") and out.count("> ") == 2

    def interrupted(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    assert cli(model_dir, "chat") == 0


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_chat_needs_a_chat_template(tmp_path, monkeypatch, capsys):
    plain = save(tmp_path / "plain", template=False)
    assert chat(plain, monkeypatch, "Hi\n") == 2
    assert "chat template" in capsys.readouterr().err


def test_cli_reports_config_errors(capsys):
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
    ("benchmark", ["--tiny", "--quant", "float,int4", "--out", "{dir}", "--target", "/nonexistent"],
     "--quant must be auto or comma-separated distinct target modes from float, gguf, gguf-int8; got 'float,int4'"),
    ("benchmark", ["--tiny", "--quant", "float,float", "--out", "{dir}", "--target", "/nonexistent"],
     "--quant must be auto or comma-separated distinct"),
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
