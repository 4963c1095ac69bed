"""The Python API's bad input (ddtree/api.py): generation arguments, prompts, compare's prompts, a method
without a drafter; each refused with a message that names the problem and the fix."""
import numpy as np
import pytest
import torch

from ddtree.api import Pair
from ddtree.bench.compare import compare
from ddtree.base.config import ConfigError
from ddtree.bench.testing import char_tokenizer, random_pair


@pytest.fixture
def pair():
    target, drafter = random_pair("llama", seed=1, max_position_embeddings=128)  # room for budget 64
    return Pair(target, drafter, None)


@pytest.mark.parametrize("kwargs,message", [
    ({"method": "ddtree", "budget": 0}, "budget must be an integer >= 1"),
    ({"method": "ddtree", "budget": -3}, "budget must be an integer >= 1"),
    ({"method": "dflash", "block_size": 1}, "block_size must be >= 2"),
    ({"method": "ddtree", "block_size": 0}, "block_size must be >= 2"),
    ({"method": "medusa"}, "unknown method 'medusa'"),
    ({"temperature": -0.5}, "temperature must be"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    # numbers of the wrong type are refused, never coerced (True would run budget 1, "0.9" would crash)
    ({"method": "ddtree", "budget": True}, "budget must be an integer >= 1"),
    ({"method": "dflash", "block_size": 2.5}, r"block_size must be >= 2 and at most the drafter.s block \(\d+\), an integer; got 2.5"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True"),
    ({"top_p": "0.9"}, "top_p must be a finite number, got '0.9'"),
    ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
    ({"temperature": True}, "temperature must be a finite number, got True"),
    ({"temperature": "1"}, "temperature must be a finite number"),
    ({"temperature": 1.0, "seed": "x"}, "seed must be an integer, got 'x'"),
    ({"temperature": 1.0, "seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"temperature": 1.0, "seed": 2**64}, "seed 18446744073709551616 does not fit in 64 bits"),  # was an OverflowError
    ({"chat": "no"}, "chat must be True or False, got 'no'"),  # "no" is truthy: it meant chat=True
])
def test_bad_generation_arguments(pair, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        pair.generate([1, 2, 3], **kwargs)


def test_a_budget_no_step_can_repay_is_refused():
    """ddtree:8000 on a CPU took 81 s for 2 tokens: refused, naming the largest budget and ddtree:auto."""
    target, drafter = random_pair("llama", seed=1, max_position_embeddings=16384)
    pair = Pair(target, drafter, None)
    for method, budget in (("ddtree:8000", None), ("ddtree", 513)):
        with pytest.raises(ConfigError, match=f"budget {budget or 8000} is more than a step can repay on cpu.*at "
                                              "most 512, or ddtree:auto"):
            pair.generate([1, 2, 3], method=method, budget=budget, max_new_tokens=2)
    assert len(pair.generate([1, 2, 3], method="ddtree:512", max_new_tokens=2).token_ids) == 2


@pytest.mark.parametrize("prompt", [5, None, True, b"\x01\x02", bytearray(b"\x01"), {1: 2}, [True, False], [1.5, 2],
                                    ["1", "2"], [[1, 2]]], ids=repr)
def test_prompts_that_are_not_text_or_token_ids(pair, prompt):
    """bytes, dicts and bools were read as token ids (b"ab" -> [97, 98]); ints and None raised a TypeError."""
    with pytest.raises(ConfigError, match="the prompt must be a string or a list of integer token ids"):
        pair.generate(prompt, max_new_tokens=2)


def test_token_ids_as_tuple_array_or_tensor(pair):
    ref = pair.generate([1, 2, 3], method="ar", max_new_tokens=3).token_ids
    for ids in ((1, 2, 3), np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), 2, 3]):
        assert pair.generate(ids, method="ar", max_new_tokens=3).token_ids == ref


def test_prompt_with_a_lone_surrogate():
    target, drafter = random_pair("llama", seed=1)
    pair = Pair(target, drafter, char_tokenizer())
    with pytest.raises(ConfigError, match="not valid Unicode .*surrogate.* at character 2"):
        pair.generate("ab\udcff", max_new_tokens=2)


@pytest.mark.parametrize("prompts,message", [
    ([], "prompts is empty"),
    ("List three colors.", "prompts must be a list of prompts, got str"),  # was: one prompt per character
    (None, "prompts must be a list of prompts, got NoneType"),
])
def test_bad_compare_prompts(pair, prompts, message):
    with pytest.raises(ConfigError, match=message):
        compare(pair, prompts, methods=["ar"], max_new_tokens=2, show=False)
    with pytest.raises(ConfigError, match="seed must be an integer"):
        compare(pair, [[1, 2]], methods=["ar"], seed="x", warmup=False, show=False)


def test_bad_prompts(pair):
    with pytest.raises(ConfigError, match="empty"):
        pair.generate([])
    with pytest.raises(ConfigError, match="empty"):
        pair.generate("")
    with pytest.raises(ConfigError, match="no tokenizer"):
        pair.generate("hello")
    with pytest.raises(ConfigError, match="context limit of 128"):
        pair.generate([1] * 129)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        pair.generate([1, 2, 10_000])


def test_speculative_method_without_drafter():
    target, _ = random_pair("llama", seed=1)
    with pytest.raises(ConfigError, match="needs a drafter"):
        Pair(target, None, None).generate([1, 2], method="ddtree")
