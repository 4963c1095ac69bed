"""Bad input gets a clear error naming the problem and the fix."""
import json

import pytest
import torch

import ddtree
from ddtree.api import Pair
from ddtree.checker import check_tokens
from ddtree.config import ConfigError
from ddtree.testing import random_pair


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
])
def test_bad_generation_arguments(pair, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        pair.generate([1, 2, 3], **kwargs)


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


def test_missing_and_corrupt_target_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ddtree.load(target=tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        ddtree.load(target=tmp_path)
    target, _ = random_pair("llama", seed=1)
    (tmp_path / "config.json").write_text(json.dumps(target.cfg.to_hf()))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        ddtree.load(target=tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match="corrupt"):
        ddtree.load(target=tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        ddtree.load(target=tmp_path)
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a .gguf"):
        ddtree.load(target=bad)


def test_bad_dtype():
    with pytest.raises(ConfigError, match="unknown dtype"):
        ddtree.load(target="/nonexistent", dtype="int3")


def test_checker_classifies_tie_flips_and_errors():
    ref = [5, 6, 7, 8]
    near_tie = torch.tensor([0.0, 10.0, 10.0 - 1e-6, 3.0])
    clear = torch.tensor([0.0, 10.0, 7.0, 3.0])
    assert check_tokens(ref, ref, lambda i: clear, torch.float32).kind == "identical"
    v = check_tokens(ref, [5, 6, 2, 2], lambda i: near_tie, torch.float32)
    assert v.kind == "tie_flip" and v.position == 2 and v.ok
    v = check_tokens(ref, [5, 6, 2, 2], lambda i: clear, torch.float32)
    assert v.kind == "error" and not v.ok and "margin 3" in v.describe()
    # bf16 noise is far larger: a 0.05 margin on logits near 10 is a tie there, an error in fp32
    small = torch.tensor([0.0, 10.0, 9.95])
    assert check_tokens(ref, [5, 1], lambda i: small, torch.bfloat16).kind == "tie_flip"
    assert check_tokens(ref, [5, 1], lambda i: small, torch.float32).kind == "error"
    # same prefix, different length: an error (a stop decision diverged)
    assert check_tokens(ref, ref[:3], lambda i: clear, torch.float32).kind == "error"


def test_checker_keeps_checking_after_a_tie_flip():
    """After a tie flip, each later token must be the target's own choice given the method's own prefix: a
    continuation that follows the target passes, one wrong token after the flip is an error at its place."""
    ref = [5, 6, 7, 8]
    near_tie = torch.tensor([0.0, 10.0, 10.0 - 1e-6, 3.0])  # token 1 and 2 tie at the divergence (position 2)
    method = [5, 6, 2, 3, 1]  # flips to 2 at position 2, then goes its own way

    def own(choices):  # the target's logits for each of the method's tokens given its own prefix
        rows = torch.zeros(len(method), 10)
        rows[torch.arange(len(method)), torch.tensor(choices)] = 9.0
        return lambda: rows

    v = check_tokens(ref, method, lambda i: near_tie, torch.float32, own([5, 6, 2, 3, 1]))
    assert v.kind == "tie_flip" and v.position == 2
    v = check_tokens(ref, method, lambda i: near_tie, torch.float32, own([5, 6, 2, 3, 4]))
    assert v.kind == "error" and v.position == 4 and v.reference_token == 4 and v.method_token == 1
    assert v.margin == pytest.approx(9.0)
    # without the method's own logits only the first divergence can be judged
    assert check_tokens(ref, method, lambda i: near_tie, torch.float32).kind == "tie_flip"


def test_cli_reports_config_errors(capsys):
    from ddtree.cli import main

    assert main(["generate", "hi", "--target", "/nonexistent/model"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["compare", "hi", "--target", "/nonexistent/model"]) == 2
