"""One method vocabulary: the parser, its errors on every entry point, the bounds, the one plain-step rule."""
import numpy as np
import pytest
import torch

from ddtree.api import Pair
from ddtree.base.config import ConfigError
from ddtree.engine.decoder import AR, AdaptiveDDTree, DDTree, DFlash, make_method
from ddtree.engine.method_spec import AUTO, DEFAULT_BUDGET, MethodSpec, default_budget, default_lookup, parse_budget, parse_methods
from ddtree.engine.stats import StageTimer
from ddtree.bench.testing import random_pair


@pytest.mark.parametrize("text,label", [("ar", "ar"), ("hf", "hf"), ("dflash", "dflash"),
                                        ("ddtree", f"ddtree:{DEFAULT_BUDGET}"), (" ddtree:16 ", "ddtree:16"),
                                        ("ddtree:auto", "ddtree:auto")])
def test_parse_and_label(text, label):
    spec = MethodSpec.parse(text)
    assert spec.label == label and MethodSpec.parse(spec.label) == spec


def test_bare_ddtree_takes_the_budget_argument_and_others_ignore_it():
    assert MethodSpec.parse("ddtree", 8) == MethodSpec("ddtree", 8)
    assert MethodSpec.parse("ddtree", "auto").adaptive
    assert MethodSpec.parse("ddtree:32", 8).budget == 32  # an explicit ddtree:N wins
    assert MethodSpec.parse("ar", 8) == MethodSpec("ar")


@pytest.mark.parametrize("value", [0, -3, False, True, 2.0, 1.5, "", " ", "0", "-1", "x", "1e3", None, [4]])
def test_bad_budgets_are_refused(value):
    with pytest.raises(ConfigError, match="budget must be an integer >= 1"):
        parse_budget(value)


@pytest.mark.parametrize("text,message", [
    ("ddtree:0", "bad budget in 'ddtree:0'"), ("ddtree:", "bad budget"), ("ddtree:-2", "bad budget"),
    ("dflash:8", "only ddtree takes a budget"), ("medusa", "unknown method 'medusa'"), ("", "unknown method ''"),
])
def test_bad_specs_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        MethodSpec.parse(text)
    with pytest.raises(ConfigError, match="budget must be an integer >= 1"):
        MethodSpec.parse("ar", 0)  # a bad budget is refused whatever the method


def test_parse_methods_expands_bare_ddtree_and_puts_ar_first():
    specs = parse_methods("dflash,ddtree,hf,ddtree:16", "8,16,auto")
    assert [s.label for s in specs] == ["ar", "dflash", "ddtree:8", "ddtree:16", "ddtree:auto", "hf"]
    assert [s.label for s in parse_methods(["ddtree"])] == ["ar", f"ddtree:{DEFAULT_BUDGET}"]
    for budgets in ("0", "16,0", ",", "8,x"):
        with pytest.raises(ConfigError, match="budget"):
            parse_methods("ddtree", budgets)


def test_bare_ddtree_defaults_to_auto_with_the_lookup_on_a_cpu_and_to_a_fixed_budget_elsewhere():
    assert default_budget("cpu") == default_budget(torch.device("cpu")) == AUTO
    assert default_budget("cuda:1") == default_budget(torch.device("cuda")) == DEFAULT_BUDGET
    assert default_budget(None) == DEFAULT_BUDGET  # device not known yet
    assert default_lookup("cpu") and not default_lookup("cuda") and not default_lookup(None)
    assert MethodSpec.parse("ddtree", device="cpu").label == "ddtree:auto+lookup"
    assert MethodSpec.parse("ddtree+lookup", device="cpu").label == "ddtree:auto+lookup"
    assert MethodSpec.parse("ddtree", 8, device="cpu").label == "ddtree:8"  # an explicit budget wins, without it
    assert MethodSpec.parse("ddtree", "auto", device="cpu").label == "ddtree:auto"
    assert MethodSpec.parse("ddtree:auto", device="cpu").label == "ddtree:auto"  # a named method is what it says
    assert MethodSpec.parse("ddtree", device="cuda").label == f"ddtree:{DEFAULT_BUDGET}"
    assert [s.label for s in parse_methods("ddtree", device="cpu")] == ["ar", "ddtree:auto+lookup"]
    assert [s.label for s in parse_methods("ddtree", "4,auto", device="cpu")] == ["ar", "ddtree:4", "ddtree:auto"]
    assert [s.label for s in parse_methods("ddtree+lookup", "4", device="cpu")] == ["ar", "ddtree:4+lookup"]


def test_a_cpu_pair_runs_a_bare_ddtree_with_the_adaptive_budget_and_the_lookup(pair):
    default = pair.method("ddtree")
    assert isinstance(default, AdaptiveDDTree) and default.lookup is not None
    assert type(pair.method("ddtree", 8)) is DDTree and pair.method("ddtree", 8).lookup is None


@pytest.fixture
def pair():
    target, drafter = random_pair("llama", seed=3, block_size=8, max_position_embeddings=96)
    return Pair(target, drafter, None)


def test_bounds_refused_with_a_clear_message(pair):
    with pytest.raises(ConfigError, match="budget 96 cannot help.*context of 96.*at most 95"):
        pair.generate([1, 2], method="ddtree:96")
    with pytest.raises(ConfigError, match="at most the drafter's block \\(8\\).*got 9"):
        pair.generate([1, 2], method="dflash", block_size=9)
    with pytest.raises(ConfigError, match="block_size must be >= 2.*got 4.0"):
        pair.generate([1, 2], method="ddtree", block_size=4.0)
    with pytest.raises(ConfigError, match="'hf' is Hugging Face generate"):
        pair.generate([1, 2], method="hf")
    assert pair.generate([1, 2], method="ddtree:95", max_new_tokens=3).stats.budget == 95
    auto = pair.method("ddtree:auto")
    assert isinstance(auto, AdaptiveDDTree) and auto.budget == 95  # auto's cap follows the context too


def test_make_method_classes_and_pair_reuses_them(pair):
    d = pair.drafter
    assert isinstance(make_method("ar"), AR)
    assert isinstance(make_method("dflash", None, None, d), DFlash)
    assert isinstance(make_method("ddtree:16", None, None, d), DDTree)
    assert pair.method("ddtree", 16) is pair.method("ddtree:16")  # one object: what auto learns carries over
    assert pair.method("ddtree:auto") is not pair.method("ddtree:auto", block_size=4)


@pytest.mark.parametrize("budget,block,length", [(1, None, 2), (2, None, 3), (4, None, 5), (7, None, 8),
                                                  (64, None, 8), ("auto", None, 8), (2, 6, 3), (16, 6, 6)])
@pytest.mark.slow
def test_ddtree_drafts_no_deeper_than_its_budget(pair, budget, block, length):
    """A tree of B nodes is at most B deep: ddtree drafts min(block, B + 1) positions, and the tree it builds
    from them still has its B nodes (the pair's drafter has block 8)."""
    assert pair.drafter.block_size == 8
    m = make_method("ddtree", budget, block, pair.drafter)
    assert m.block_size == length
    m.prepare(pair.target, pair.drafter)
    seen = []
    draft = pair.drafter.draft
    pair.drafter.draft = lambda cache, bonus, n: seen.append(n) or draft(cache, bonus, n)
    try:
        dcache = pair.drafter.new_cache(64)
        pair.drafter.add_context(dcache, torch.randn(3, len(pair.drafter.cfg.target_layer_ids) * 64))
        if isinstance(m, AdaptiveDDTree):
            m.gate.rate = None  # no evidence yet: drafts
        tree = m.propose(pair.drafter, pair.decoder.ops, dcache, torch.tensor([5]), 40, StageTimer("cpu"))
    finally:
        del pair.drafter.draft
    assert seen == [length]
    if budget != "auto":
        assert tree.size == min(budget, 39) + 1 and tree.depths.max() <= length - 1  # room 40: 39 nodes at most


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree:16", "ddtree:auto"])
def test_plain_step_decided_in_one_place(pair, method):
    """Method.propose gives the lone root when no draft of >= 1 token fits the room left; else a real draft."""
    m = pair.method(method)
    m.prepare(pair.target, pair.drafter)
    if m.uses_drafter:  # draft(), never reached for a plain step
        m.draft = lambda *args: pytest.fail("drafted with no room for a draft")
    dcache = pair.drafter.new_cache(64)
    pair.drafter.add_context(dcache, torch.zeros(1, len(pair.drafter.cfg.target_layer_ids) * 64))
    bonus = torch.tensor([5])
    tree = m.propose(pair.drafter, pair.decoder.ops, dcache, bonus, 1, StageTimer("cpu"))
    assert tree.size == 1 and tree.tokens.tolist() == [5] and tree.parents.tolist() == [-1]
    if m.uses_drafter:
        del m.draft
        if isinstance(m, AdaptiveDDTree):
            m.gate.rate = None  # no evidence yet: drafts
        tree = m.propose(pair.drafter, pair.decoder.ops, dcache, bonus, 40, StageTimer("cpu"))
        assert tree.size > 1 and np.all(tree.parents[1:] < np.arange(1, tree.size))


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--budget", "0"], "budget must be an integer >= 1"),
    (["generate", "hi", "--method", "ddtree:0"], "bad budget in 'ddtree:0'"),
    (["generate", "hi", "--method", "medusa"], "unknown method 'medusa'"),
    (["compare", "hi", "--methods", "ar,ddtree:0"], "bad budget in 'ddtree:0'"),
    (["compare", "hi", "--budget", "False"], "budget must be an integer >= 1"),
])
def test_cli_refuses_bad_specs_before_loading(argv, message, capsys):
    from ddtree.cli import main

    assert main(argv + ["--target", "/nonexistent/model"]) == 2  # the spec error comes before the load's
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [(["--budgets", "0"], "got '0'"), (["--methods", "ar,ddtree:0"], "ddtree:0"),
                                          (["--budgets", "16,-1"], "got '-1'")])
def test_benchmark_refuses_bad_specs(argv, message, tmp_path, capsys):
    """`--budgets 0` used to run budget 64 silently."""
    from ddtree.bench.benchmark import main

    assert main(argv + ["--target", "/nonexistent/model", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_auto_keeps_what_it_learns_per_sampling_setting(pair):
    """auto's trust in the drafter, its gate and its draft length are per sampling setting: what a T = 1 prompt
    teaches it does not carry into the next greedy one; greedy is one setting whatever its top-p / top-k."""
    from ddtree.base.config import SamplingParams

    m = make_method("ddtree:auto", None, None, pair.drafter)
    m.prepare(pair.target, pair.drafter)  # greedy
    m.calibration.c, m.gate.rate, m.block_size = 0.5, 123.0, 3
    m.prepare(pair.target, pair.drafter, SamplingParams(1.0))
    assert (m.calibration.c, m.gate.rate, m.block_size) == (1.0, None, m.max_length)  # fresh for T = 1
    m.calibration.c = 0.2
    m.prepare(pair.target, pair.drafter, SamplingParams(0.0, top_p=0.9))  # greedy again
    assert (m.calibration.c, m.gate.rate, m.block_size) == (0.5, 123.0, 3)
    m.prepare(pair.target, pair.drafter, SamplingParams(1.0))
    assert m.calibration.c == 0.2
    m.prepare(pair.target, pair.drafter, SamplingParams(0.7))  # another temperature: its own
    assert m.calibration.c == 1.0
