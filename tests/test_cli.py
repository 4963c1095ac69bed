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
from ddtree.bench.testing import char_tokenizer, random_pair, save_target

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
    from ddtree.bench import benchmark
    from ddtree import cli
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
    ("train", ["fit", "--data", "{data}", "--out", "{dir}", "--resume", "--draft-vocab", "64", "--target",
               "/nonexistent"], "--draft-vocab shapes a new run's drafter; .*drop --draft-vocab"),
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


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_a_long_chat_drops_its_oldest_turns_and_keeps_going(pair, monkeypatch, capsys):
    """A conversation that outgrows the target's context (512 tokens here) loses its oldest turns, not the session:
    the system message stays, every prompt leaves room for the answer, a notice says what was dropped; a message
    that alone does not fit is refused and the conversation goes on; every line of input is answered."""
    from ddtree.cli import chat_loop
    from ddtree.engine.method_spec import MethodSpec

    context = pair.target.cfg.max_position_embeddings
    sent = []
    stream = pair.stream
    monkeypatch.setattr(pair, "stream", lambda ids, **kw: sent.append(list(ids)) or stream(ids, **kw))
    lines = [f"question {i}: " + "tell me more about it " * 5 for i in range(8)]
    script = lines[:5] + ["x" * (context + 10)] + lines[5:]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in script)))
    decoding = dict(block_size=None, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, stop=[],
                    stop_token_ids=None)
    assert chat_loop(pair, MethodSpec.parse("ar", None, "cpu"), None, "SYSTEM", decoding) == 0
    out, err = capsys.readouterr()
    assert len(sent) == len(lines) and out.count("> ") == len(script) + 1  # all answered; the long one refused
    assert all(len(ids) + 12 <= context for ids in sent)
    assert all(pair.decode(ids).startswith("s: SYSTEM\n") for ids in sent)
    assert all(f"question {i}" in pair.decode(ids) for i, ids in enumerate(sent))
    assert "question 0" not in pair.decode(sent[-1]) and "question 6" in pair.decode(sent[-1])
    assert re.search(r"\[context: the oldest \d+ turns? dropped to fit the target's 512-token context", err)
    assert re.search(r"prompt of \d+ tokens with the system message, and the target's context holds 512: send a "
                     r"shorter one; not sent, the conversation is kept", err)


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
@pytest.mark.parametrize("stdin", ["none", "closed"])
def test_chat_ends_cleanly_when_stdin_is_closed(model_dir, stdin, monkeypatch, capsys):
    """`chat <&-` (no stdin: "input(): lost sys.stdin") or a closed one: exit 0, no traceback."""
    closed = io.StringIO("Hi\n")
    closed.close()
    monkeypatch.setattr("sys.stdin", None if stdin == "none" else closed)
    assert cli(model_dir, "chat") == 0
    err = capsys.readouterr().err
    assert "stdin is closed" in err and "Traceback" not in err


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_generate_stream_into_a_closed_pipe_ends_quietly(model_dir):
    """`python -m ddtree generate --stream | head -c 10`: head closes the pipe after 10 bytes; the command ends with
    exit 0 and says nothing more (a BrokenPipeError traceback before)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ddtree", "generate", "Tell me a story", "--stream", "--max-new-tokens", "64",
           "--method", "ar", "--target", model_dir, "--device", "cpu", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ,
                                                                                      "PYTHONWARNINGS": "ignore"})
    proc.stdout.close()  # what head does after its bytes; here before the first one, so that the writes surely fail
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "[ar] 64 tokens" not in err  # it stopped at the closed pipe
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_stream_result_before_the_loop_ends_says_so():
    """stream.result is the result once the stream is consumed; before that a ConfigError says what to do (None
    before, and an AttributeError on .stats)."""
    from ddtree.api import Pair
    from ddtree.base.config import ConfigError
    from ddtree.bench.testing import random_pair

    target, drafter = random_pair("llama", seed=11)
    pair = Pair(target, drafter, char_tokenizer())
    stream = pair.stream("Hello", method="ar", max_new_tokens=6, chat=False)
    with pytest.raises(ConfigError, match="stream.result is ready once the stream is consumed: iterate over it"):
        stream.result
    text = "".join(stream)
    assert stream.result.text == text and stream.result.stats.new_tokens == 6


@pytest.mark.parametrize("value", ["yes", "no", 1, None])
def test_trace_must_be_a_bool(value):
    from ddtree.api import Pair
    from ddtree.base.config import ConfigError
    from ddtree.bench.testing import random_pair

    pair = Pair(*random_pair("llama", seed=11), None)
    with pytest.raises(ConfigError, match=f"trace must be True or False, got {value!r}"):
        pair.generate([1, 2, 3], method="ar", max_new_tokens=4, trace=value)
    assert pair.generate([1, 2, 3], method="ar", max_new_tokens=4, trace=True).trace is not None


def test_markov_head_on_a_drafter_without_one_is_refused(model_dir, capsys):
    """markov_head=True (--markov-head) with a drafter that has no head: a ConfigError naming the fix, not a silent
    run without it."""
    from ddtree.base.config import ConfigError

    with pytest.warns(UserWarning, match="no trained drafter"), \
            pytest.raises(ConfigError, match=r"markov_head=True, and the drafter \(untrained\) has no Markov head"):
        ddtree.load(target=model_dir, device="cpu", dtype="float32", markov_head=True)
    with pytest.warns(UserWarning, match="no trained drafter"):
        assert cli(model_dir, "generate", "hi", "--markov-head", "--max-new-tokens", "2") == 2
    assert "has no Markov head: drop markov_head (--markov-head)" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
@pytest.mark.parametrize("method", ["ar", "ddtree:4"])
def test_a_one_token_answer_has_tau_one(model_dir, method, capsys):
    """An answer that ends at the prefill's token had no decoding step: tau is 1.00 (nothing drafted, nothing
    gained), not 0.00."""
    assert cli(model_dir, "generate", "Hi", "--method", method, "--max-new-tokens", "1") == 0
    assert ", tau 1.00, " in capsys.readouterr().err
    assert cli(model_dir, "generate", "Hi", "--method", method, "--max-new-tokens", "1", "--json") == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["steps"] == 0 and stats["tau"] == 1.0
