"""Benchmark prompt files and dataset names (ddtree/bench/datasets.py)."""
import pytest

from ddtree.base.config import ConfigError


@pytest.mark.parametrize("line,message", [
    ('{"turns": "abc"}', r"p.jsonl:3: expected a string, .*\{\"turns\": \[\"...\", ...\]\}"),  # was read as "a"
    ('{"turns": []}', "p.jsonl:3: expected a string"),
    ('{"prompt": 5}', "p.jsonl:3: expected a string"),
    ('{"prompt": ""}', "p.jsonl:3: the prompt is empty"),  # was found mid-run, after the earlier prompts ran
    ('{"question": "  "}', "p.jsonl:3: the prompt is empty"),
    ('{"prompt": "x",}', r"p.jsonl:3: not valid JSON \(Expecting property name"),
    # a lone surrogate (JSON's \ud800 escape): was a raw UnicodeEncodeError traceback from the benchmark
    ('{"prompt": "a\\ud800b"}', r"p.jsonl:3: the prompt is not valid Unicode \(surrogates not allowed: '\\ud800' at "
                                r"character 1\)"),
    ('{"prompt": "a", "stop": ["\\udfff"]}', r"p.jsonl:3: a stop string is not valid Unicode"),
])
def test_bad_benchmark_prompt_file(tmp_path, line, message):
    from ddtree.bench.datasets import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + '\n{"turns": ["also fine", "second turn"]}\n')
    with pytest.raises(ConfigError, match=message):
        load_prompts(str(path), 1)  # the whole file is checked up front, not only the prompts asked for


def test_a_dataset_path_that_does_not_exist(tmp_path):
    """Reported as a missing file, not as an unknown dataset name."""
    from ddtree.bench.datasets import load_prompts

    with pytest.raises(ConfigError, match="dataset file .*nope.jsonl' does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"), 1)
    with pytest.raises(ConfigError, match="unknown dataset 'humaneva'"):
        load_prompts("humaneva", 1)


def test_good_benchmark_prompt_file(tmp_path):
    from ddtree.bench.datasets import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n{"prompt": "a"}\n{"turns": ["b", "c"]}\n{"question": "d"}\n')
    assert load_prompts(str(path), 9) == ["plain", "a", "b", "d"]


def test_prompt_entries_say_where_each_prompt_comes_from(tmp_path):
    """PATH:LINE of a JSONL file, dataset and 0-based index of a built-in set: what the benchmark's messages name."""
    from ddtree.bench.datasets import load_prompt_entries, load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n\n{"prompt": "a", "stop": "x"}\n')
    assert load_prompt_entries(str(path), 9) == [("plain", (), f"{path}:1"), ("a", ("x",), f"{path}:3")]
    entries = load_prompt_entries("humaneval", 2)
    assert [where for _, _, where in entries] == ["dataset humaneval, prompt index 0", "dataset humaneval, prompt index 1"]
    assert [prompt for prompt, _, _ in entries] == load_prompts("humaneval", 2)
