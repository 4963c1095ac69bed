"""The llamacpp peer method: its spelling, its clear skip without llama-cpp-python, its agreement report, and
(where llama-cpp-python is installed) a real run on the embedded target."""
import sys
import warnings

import pytest

from ddtree.api import Pair
from ddtree.base.config import ConfigError
from ddtree.engine.method_spec import MethodSpec, parse_methods
from ddtree.bench.peers import available
from ddtree.bench.runner import agreement
from ddtree.bench.testing import random_pair


@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError


def test_spelling():
    assert MethodSpec.parse("llamacpp").label == "llamacpp"
    spec = MethodSpec.parse("llamacpp:gguf")
    assert (spec.name, spec.variant, spec.label, spec.peer) == ("llamacpp", "gguf", "llamacpp:gguf", True)
    assert [s.label for s in parse_methods("hf,llamacpp,llamacpp:gguf")] == ["ar", "hf", "llamacpp", "llamacpp:gguf"]
    for bad in ("llamacpp:q5", "ar:gguf", "llamacpp:16"):
        with pytest.raises(ConfigError, match="llamacpp:gguf"):
            MethodSpec.parse(bad)


def test_not_a_decoding_loop_method():
    target, drafter = random_pair("llama", seed=3)
    with pytest.raises(ConfigError, match="llama.cpp's plain decoding.*compare and the benchmark"):
        Pair(target, drafter, None).generate([1, 2], method="llamacpp")


def test_absence_skips_with_a_clear_message(no_llama_cpp):
    said = []
    specs = available(parse_methods("llamacpp,llamacpp:gguf,ddtree:4"), said.append)
    assert [s.label for s in specs] == ["ar", "ddtree:4"]
    assert len(said) == 2 and all("skipped: llama-cpp-python is not installed" in line and "pip install" in line
                                  for line in said)


def test_compare_runs_the_rest_without_llama_cpp(no_llama_cpp, capsys):
    import ddtree

    target, drafter = random_pair("llama", seed=3)
    result = ddtree.compare(Pair(target, drafter, None), [[1, 2, 3]], methods=["ar", "llamacpp", "dflash"],
                            max_new_tokens=4, show=False, warmup=False)
    assert [r["method"] for r in result.rows] == ["ar", "dflash"]
    assert "method llamacpp skipped: llama-cpp-python is not installed" in capsys.readouterr().err


def test_agreement_is_the_shared_prefix_share():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert agreement([1, 2, 3, 4], [1, 2]) == 0.5  # stopped early
    assert agreement([1, 2], [1, 2, 3]) == 1.0


@pytest.mark.real_model
def test_llama_cpp_decodes_the_same_weights():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra: pip install -e "
                                            "'.[llamacpp]'); the llamacpp method is skipped without it")
    import torch

    import ddtree
    from ddtree.bench.runner import RunSettings, run_prompt
    from ddtree.bench.peers import Peers

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pair = ddtree.load(dtype="float32", device="cpu")
    specs = parse_methods("llamacpp,llamacpp:gguf")
    recs = run_prompt(pair, "List three colors.", specs, RunSettings(12), peers=Peers(pair))
    by = {r["method"]: r for r in recs}
    assert by["llamacpp"]["new_tokens"] > 0 and by["llamacpp"]["tokens_per_second"] > 0
    # the same F32 weights: only a rounding near-tie may split them (1.0 when measured), never the first tokens
    assert by["llamacpp"]["agreement"] >= 0.5
    assert 0.0 <= by["llamacpp:gguf"]["agreement"] <= 1.0 and by["llamacpp:gguf"]["check"] != "error"
