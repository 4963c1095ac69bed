"""load()'s options (ddtree/base/options.py): one rule for every knob, an explicit argument > its DDTREE_*
variable > the default, read once at load; the CLI and the benchmark take their model flags from one function;
threads that fit the machine."""
from __future__ import annotations

import argparse

import types

import pytest
import torch

from ddtree.base import options as opts
from ddtree.base.config import ConfigError
from ddtree.base.options import LoadOptions, Quant, add_model_args, load_options_from, load_threads

KNOBS = ("DDTREE_CPU_KERNEL", "DDTREE_CPU_ISA", "DDTREE_GGUF_BLOCKS", "DDTREE_MARKOV_HEAD", "DDTREE_CUDA_GRAPHS",
         "DDTREE_ATTENTION", "DDTREE_THREADS", "DDTREE_NGRAM_TABLE")


@pytest.fixture(autouse=True)
def _no_knobs(monkeypatch):
    for name in KNOBS:
        monkeypatch.delenv(name, raising=False)


# knob: (LoadOptions.resolve keyword, an argument, the variable, its value (not the argument's), the option
# field, what the argument gives, what the variable gives, the default)
CASES = {
    "cpu_kernel": ("cpu_kernel", "avx2", "DDTREE_CPU_KERNEL", "0", "kernel", "avx2", "off", "auto"),
    "cpu_kernel off": ("cpu_kernel", "off", "DDTREE_CPU_KERNEL", "1", "kernel", "off", "auto", "auto"),
    "cpu_isa": ("cpu_kernel", "avx2", "DDTREE_CPU_ISA", "avx512", "cpu_isa", "avx2", "avx512", "auto"),
    "gguf_blocks": ("gguf_blocks", True, "DDTREE_GGUF_BLOCKS", "off", "gguf_blocks", True, False, True),
    "markov_head": ("markov_head", False, "DDTREE_MARKOV_HEAD", "yes", "markov_head", False, True, False),
    "cuda_graphs": ("cuda_graphs", True, "DDTREE_CUDA_GRAPHS", "false", "cuda_graphs", True, False, True),
    "attention": ("attention", "sdpa", "DDTREE_ATTENTION", "triton", "attention", "sdpa", "triton", "auto"),
    "threads": ("threads", 3, "DDTREE_THREADS", "5", "threads", 3, 5, None),
}


@pytest.mark.parametrize("knob", list(CASES))
def test_every_knob_argument_beats_environment_beats_default(knob, monkeypatch):
    keyword, argument, variable, value, field, from_argument, from_variable, default = CASES[knob]
    assert getattr(LoadOptions.resolve(), field) == default
    assert getattr(LoadOptions(), field) == default  # the defaults a pair made by hand takes
    monkeypatch.setenv(variable, value)
    assert getattr(LoadOptions.resolve(), field) == from_variable
    assert getattr(LoadOptions.resolve(**{keyword: None}), field) == from_variable  # None is not given
    assert getattr(LoadOptions.resolve(**{keyword: argument}), field) == from_argument


@pytest.mark.parametrize("variable", ["DDTREE_CPU_KERNEL", "DDTREE_GGUF_BLOCKS", "DDTREE_MARKOV_HEAD",
                                      "DDTREE_CUDA_GRAPHS"])
def test_every_boolean_knob_takes_the_same_spellings(variable, monkeypatch):
    """DDTREE_CUDA_GRAPHS took only 0/1 (false/off were refused); now every boolean takes knobs.py's spellings."""
    field = {"DDTREE_CPU_KERNEL": "cpu_kernel"}.get(variable, variable.removeprefix("DDTREE_").lower())
    for value, expected in (("false", False), ("OFF", False), ("no", False), ("0", False),
                            ("true", True), ("On", True), ("yes", True), ("1", True)):
        monkeypatch.setenv(variable, value)
        assert getattr(LoadOptions.resolve(), field) is expected, value
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ConfigError, match=f"{variable}='maybe' is not a boolean"):
        LoadOptions.resolve()


def test_auto_is_not_a_choice_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("DDTREE_ATTENTION", "sdpa")
    monkeypatch.setenv("DDTREE_CPU_ISA", "avx2")
    resolved = LoadOptions.resolve(cpu_kernel="auto", attention="auto")  # "auto" leaves it to the environment
    assert resolved.attention == "sdpa" and resolved.kernel == "avx2"
    monkeypatch.setenv("DDTREE_CPU_KERNEL", "0")  # off beats an ISA named beside it
    assert LoadOptions.resolve().kernel == "off"
    assert LoadOptions.resolve(cpu_kernel="avx512").kernel == "avx512"  # the argument turns it back on
    for variable, value, message in (("DDTREE_CPU_ISA", "sse4", "DDTREE_CPU_ISA='sse4' is not valid"),
                                     ("DDTREE_ATTENTION", "flash9", "DDTREE_ATTENTION='flash9' is not valid"),
                                     ("DDTREE_THREADS", "0", "DDTREE_THREADS='0' is not valid"),
                                     ("DDTREE_THREADS", "two", "DDTREE_THREADS='two' is not valid")):
        monkeypatch.delenv("DDTREE_CPU_KERNEL", raising=False)
        monkeypatch.setenv(variable, value)
        with pytest.raises(ConfigError, match=message):
            LoadOptions.resolve()
        monkeypatch.delenv(variable)
    monkeypatch.setenv("DDTREE_ATTENTION", " SDPA ")  # any case, blanks around
    assert LoadOptions.resolve().attention == "sdpa"
    for kw, message in ((dict(cpu_kernel="fast"), "unknown cpu_kernel 'fast'"),
                        (dict(gguf_blocks="no"), "gguf_blocks must be True or False"),
                        (dict(markov_head=1), "markov_head must be True or False"),
                        (dict(cuda_graphs="off"), "cuda_graphs must be True or False"),
                        (dict(attention="flash9"), "unknown attention backend 'flash9'"),
                        (dict(threads=0), "threads must be >= 1"), (dict(threads=1.5), "threads must be an integer"),
                        (dict(quant="gguf-int4"), "unknown quant 'gguf-int4'")):
        with pytest.raises(ConfigError, match=message):
            LoadOptions.resolve(**kw)


def test_quant_is_an_enum():
    assert Quant.parse(None) is None and Quant.parse("gguf") is Quant.GGUF
    assert Quant.parse(Quant.GGUF_INT8) is Quant.GGUF_INT8 and Quant.GGUF_INT8.int8 and not Quant.GGUF.int8
    assert LoadOptions.resolve(quant="gguf-int8").int8 and not LoadOptions.resolve(quant="gguf").int8
    assert not LoadOptions().int8 and opts.QUANTS == ("gguf", "gguf-int8")
    with pytest.raises(ConfigError, match="unknown quant 'gguf int8'"):
        Quant.parse("gguf int8")


def test_threads_fit_the_machine(monkeypatch, capsys):
    """Not given: the cores other processes leave free, never more than the process has, with a notice when they
    are busy (generate and chat used 2 threads beside a busy process: 30-90x slower than one)."""
    monkeypatch.setattr("ddtree.base.machine_load.os.cpu_count", lambda: 2)
    monkeypatch.setattr(opts, "busy_cores", lambda seconds=0.5: 1.1)
    assert load_threads(LoadOptions(), current=2) == 1
    assert "other processes keep 1.1 cores busy: 1 thread(s)" in capsys.readouterr().err
    monkeypatch.setattr(opts, "busy_cores", lambda seconds=0.5: 0.1)
    assert load_threads(LoadOptions(), current=2) == 2 and capsys.readouterr().err == ""
    assert load_threads(LoadOptions(), current=1) == 1  # never raised above what the process has
    monkeypatch.setattr(opts, "busy_cores", lambda seconds=0.5: pytest.fail("measured although given"))
    assert load_threads(LoadOptions(threads=2), current=1) == 2
    monkeypatch.setattr(opts, "busy_cores", lambda seconds=0.5: pytest.fail("a meter was given"))
    meter = types.SimpleNamespace(lap_after=lambda seconds: 1.2)  # made when the load began (api.load)
    assert load_threads(LoadOptions(), current=2, meter=meter) == 1
    monkeypatch.setenv("DDTREE_THREADS", "3")
    assert load_threads(LoadOptions.resolve(), current=1) == 3
    assert load_threads(LoadOptions.resolve(threads=1), current=2) == 1


def test_the_benchmark_and_the_cli_share_the_default_threads():
    """One rule: the benchmark's per-process default is machine_load.default_threads, as load()'s."""
    from ddtree.base import machine_load
    from ddtree.bench import benchmark

    assert benchmark.default_threads is machine_load.default_threads is opts.default_threads


def _flags(parser: argparse.ArgumentParser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


MODEL_FLAGS = ("--target", "--draft", "--markov-head", "--device", "--dtype", "--attention", "--cpu-kernel",
               "--no-gguf-blocks", "--backend", "--threads")


def test_the_cli_and_the_benchmark_take_their_model_flags_from_one_function():
    """Every command (generate, compare, chat, serve) and the benchmark have add_model_args' flags, with the same
    help and defaults (the benchmark lacked --backend); the benchmark's --quant is its list of target modes."""
    from ddtree.bench import benchmark
    from test_docs import cli_parser, subcommand

    reference = argparse.ArgumentParser()
    add_model_args(reference)
    ref = _flags(reference)
    parsers = {name: subcommand(cli_parser(), name) for name in ("generate", "compare", "chat", "serve")}
    seen = {}
    orig = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        seen["bench"] = self
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab
    try:
        with pytest.raises(SystemExit):
            benchmark.parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = orig
    parsers["benchmark"] = seen["bench"]
    for name, parser in parsers.items():
        flags = _flags(parser)
        for flag in MODEL_FLAGS:
            assert flag in flags, f"{name} lacks {flag}"
            assert (flags[flag].help, flags[flag].default) == (ref[flag].help, ref[flag].default), (name, flag)
        if name != "benchmark":
            assert flags["--quant"].choices == ref["--quant"].choices
    assert _flags(parsers["benchmark"])["--quant"].metavar == "MODES"


def test_flags_not_given_leave_the_knobs_to_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    kw = load_options_from(parser.parse_args([]))
    assert kw == dict(target=None, draft=None, device=None, dtype=None, attention_backend="auto", backend="auto",
                      quant=None, cpu_kernel="auto", gguf_blocks=None, markov_head=None, threads=None,
                      ngram_table=None)
    monkeypatch.setenv("DDTREE_GGUF_BLOCKS", "0")
    monkeypatch.setenv("DDTREE_MARKOV_HEAD", "1")
    resolved = LoadOptions.resolve(kw["cpu_kernel"], kw["gguf_blocks"], kw["markov_head"], None,
                                   kw["attention_backend"], kw["quant"], kw["threads"])
    assert not resolved.gguf_blocks and resolved.markov_head
    kw = load_options_from(parser.parse_args(["--no-gguf-blocks", "--markov-head", "--threads", "1", "--quant",
                                              "gguf", "--cpu-kernel", "off", "--backend", "own", "--no-ngram-table"]))
    assert (kw["gguf_blocks"], kw["markov_head"], kw["threads"], kw["quant"], kw["cpu_kernel"], kw["backend"],
            kw["ngram_table"]) == (False, True, 1, "gguf", "off", "own", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])


def test_load_reads_the_options_once_and_sets_the_threads(tmp_path, monkeypatch):
    """load(threads=) sets torch's threads once, at load; the pair keeps its options; the environment is not read
    again on the step path (a bad value set after the load changes nothing)."""
    import ddtree
    from ddtree.bench.testing import random_pair, save_target

    target, drafter = random_pair("llama", seed=1, num_draft_layers=2)
    drafter.model.save(tmp_path / "drafter")
    target_dir, draft_dir = save_target(target, tmp_path / "target"), tmp_path / "drafter"
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("DDTREE_GGUF_BLOCKS", "no")
        pair = ddtree.load(target=target_dir, draft=draft_dir, threads=2, cpu_kernel="off")
        assert torch.get_num_threads() == 2
        assert pair.options.threads == 2 and not pair.options.gguf_blocks and pair.options.kernel == "off"
        assert pair.target.kernel is None  # cpu_kernel="off" reached the runtime
        for name in KNOBS:
            monkeypatch.setenv(name, "bogus")
        torch.set_num_threads(1)
        assert len(pair.generate([1, 2, 3], method="ddtree:4", max_new_tokens=4).token_ids) == 4
        assert torch.get_num_threads() == 1  # generate does not set threads
    finally:
        torch.set_num_threads(before)


def test_a_pair_without_cuda_graphs_gets_no_gpu_runtime(monkeypatch):
    """cuda_graphs=False (or DDTREE_CUDA_GRAPHS=0/false/off) keeps the CUDA-graph runtime off the pair."""
    from ddtree import api
    from ddtree.bench.testing import random_pair
    from ddtree.runtime import attach as runtime_attach

    target, drafter = random_pair("llama", seed=1, num_draft_layers=1)
    calls = []
    monkeypatch.setattr(runtime_attach.gpu_runtime, "attach", lambda t, d: calls.append(1) or (t, d))
    api.Pair(target, drafter, None)
    assert calls == [1]
    monkeypatch.setenv("DDTREE_CUDA_GRAPHS", "off")
    api.Pair(target, drafter, None, options=LoadOptions.resolve())
    assert calls == [1]
