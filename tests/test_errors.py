"""Bad input gets a clear error naming the problem and the fix."""
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import ddtree
from ddtree.api import Pair
from ddtree.cache import checksum
from ddtree.checker import check_tokens
from ddtree.compare import compare
from ddtree.config import ConfigError
from ddtree.loading import resolve_target_dir, verify_cache
from ddtree.testing import char_tokenizer, random_pair, save_target


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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # the hf backend's, still corrupt
    with pytest.raises(ConfigError, match="cannot load the 'gpt2' model"):
        ddtree.load(target=tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "made_up_arch"}))
    with pytest.raises(ConfigError, match="model_type 'made_up_arch'"):
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


# --- loading: checked before the model load, named mismatches instead of torch's size errors -----------------
@pytest.mark.parametrize("device,message", [
    pytest.param("cuda", "device 'cuda' is not available", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA is available here")),
    pytest.param("mps", "device 'mps' is not available", marks=pytest.mark.skipif(
        torch.backends.mps.is_available(), reason="MPS is available here")),
    ("gpu", "unknown device 'gpu'"),
    ("meta", "device 'meta' is not supported"),
])
def test_unusable_device_fails_before_loading(device, message):
    # the target does not exist: the device error must come first, i.e. before any model is loaded
    with pytest.raises(ConfigError, match=message):
        ddtree.load(target="/nonexistent", device=device)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.complex64, "int8", 16])
def test_non_float_dtype(dtype):
    with pytest.raises(ConfigError, match="unknown dtype"):
        ddtree.load(target="/nonexistent", dtype=dtype)


@pytest.fixture
def model_dirs(tmp_path):
    """A saved tiny target and a drafter for it (published format)."""
    target, drafter = random_pair("llama", seed=1, num_draft_layers=2)
    drafter.save(tmp_path / "drafter")
    return save_target(target, tmp_path / "target"), tmp_path / "drafter"


def _edit_json(path, **changes):
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    path.write_text(json.dumps(cfg))


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_target_config_that_does_not_match_its_weights(model_dirs):
    target_dir, _ = model_dirs
    assert ddtree.load(target=target_dir).target.cfg.hidden_size == 64
    _edit_json(target_dir / "config.json", hidden_size=None)
    with pytest.raises(ConfigError, match=r"config.json lacks hidden_size: restore"):
        ddtree.load(target=target_dir)
    _edit_json(target_dir / "config.json", hidden_size=128)
    with pytest.raises(ConfigError, match=r"do not match its config.json: model.embed_tokens.weight is \[96, 64\] in "
                                          r"the weights but \[96, 128\] by config.json"):
        ddtree.load(target=target_dir)


def test_hidden_size_not_a_multiple_of_the_heads(model_dirs):
    """Without a head_dim, hidden_size must split into the heads (a raw traceback before)."""
    target_dir, _ = model_dirs
    _edit_json(target_dir / "config.json", hidden_size=65, head_dim=None)
    with pytest.raises(ConfigError, match=r"hidden_size \(65\) is not a multiple of num_attention_heads"):
        ddtree.load(target=target_dir)


def test_drafter_that_does_not_match_the_target(model_dirs):
    target_dir, drafter_dir = model_dirs
    assert ddtree.load(target=target_dir, draft=drafter_dir).drafter.cfg.model.num_layers == 2
    config = json.loads((drafter_dir / "config.json").read_text())
    _edit_json(drafter_dir / "config.json", hidden_size=128)  # the project's check, not torch's size mismatch
    with pytest.raises(ConfigError, match="drafter does not match the target: hidden_size 128 != target's 64"):
        ddtree.load(target=target_dir, draft=drafter_dir)
    (drafter_dir / "config.json").write_text(json.dumps(config))
    _edit_json(drafter_dir / "config.json", dflash_config={**config["dflash_config"], "target_layer_ids": [1, 2, 3]})
    with pytest.raises(ConfigError, match=r"fc.weight is \[64, 128\] in the weights but \[64, 192\] by config.json"):
        ddtree.load(target=target_dir, draft=drafter_dir)


# --- the dequantized GGUF cache: checksummed at conversion, verified on every load ---------------------------
@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf path whose "dequantization" is a tiny seeded model (the real one takes ~20 s), in a private
    DDTREE_CACHE. Returns (path, list of conversions done)."""
    from ddtree import loading
    from ddtree.hf_baseline import to_hf_model

    conversions = []

    def read_gguf(path):
        conversions.append(path)
        target, _ = random_pair("llama", seed=1)
        return to_hf_model(target), char_tokenizer()

    monkeypatch.setattr(loading, "read_gguf", read_gguf)
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.Q4.gguf"
    path.write_bytes(b"GGUF")
    return path, conversions


def _cached(fake_gguf):
    return resolve_target_dir(fake_gguf[0])


def _greedy(target_path) -> list[int]:
    pair = ddtree.load(target=target_path, device="cpu", dtype="float32")
    return pair.generate("Hello there", method="ar", max_new_tokens=6).token_ids


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete the checksums"])
def test_damaged_cache_is_detected_and_rebuilt(fake_gguf, damage, capsys):
    path, conversions = fake_gguf
    reference = _greedy(path)
    cached = _cached(fake_gguf)
    assert len(conversions) == 1 and (cached / "ddtree-cache.json").is_file()
    assert _greedy(path) == reference and len(conversions) == 1  # verified, not converted again
    weights = cached / "model.safetensors"
    original = weights.read_bytes()
    data = bytearray(original)
    if damage == "flip a byte":  # same size: loads fine and changes the model unless the checksum catches it
        data[-5] ^= 0x40
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:  # e.g. a cache written by an older version, or a conversion killed before it finished
        (cached / "ddtree-cache.json").unlink()
    capsys.readouterr()
    assert _greedy(path) == reference and len(conversions) == 2
    err = capsys.readouterr().err
    assert f"the cached conversion {cached} is damaged" in err and "converting again" in err
    assert weights.read_bytes() == original and not verify_cache(cached)


def test_untouched_cache_is_not_hashed_again(fake_gguf, monkeypatch):
    """A load checks stat stamps; the files are hashed again only when a stamp changed (any write changes it)."""
    from ddtree import cache

    monkeypatch.setattr(cache, "STAMP_SETTLE_NS", -1)  # record stamps at once, not 2 s after the last write
    hashed = []
    monkeypatch.setattr(cache, "checksum", lambda p: hashed.append(Path(p).name) or checksum(p))
    cached = _cached(fake_gguf)
    assert "model.safetensors" in hashed  # at conversion
    done = len(hashed)
    assert _cached(fake_gguf) == cached and len(hashed) == done  # untouched: a few stat calls, no hashing
    weights = cached / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # touched (e.g. copied), same bytes
    assert _cached(fake_gguf) == cached and "model.safetensors" in hashed[done:]
    assert len(fake_gguf[1]) == 1  # intact: verified by hash, not converted again
    done = len(hashed)
    assert _cached(fake_gguf) == cached and len(hashed) == done  # its new stamps were recorded


def test_a_killed_conversions_staging_is_swept(fake_gguf, tmp_path):
    """A conversion killed half-way leaves a hidden staging folder as big as the model: the next conversion or
    load removes it once its process is gone (and never a live process's)."""
    import subprocess
    import sys

    from ddtree.loading import gguf_cache_dir

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    out = gguf_cache_dir(fake_gguf[0])
    left = out.with_name(f".{out.name}.tmp{proc.pid}")  # the name main's conversions stage under
    live = out.with_name(f".{out.name}.tmp{os.getpid()}")
    for folder in (left, live):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
    _cached(fake_gguf)
    assert not left.exists() and live.exists()


def test_a_full_disk_while_converting_names_the_fix(fake_gguf, monkeypatch):
    """safetensors reports a full disk as its own error type (a raw traceback before)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ConfigError, match="cannot write the converted model in .*: the disk is full; free some"):
        _cached(fake_gguf)
    assert [p.name for p in Path(os.environ["DDTREE_CACHE"]).iterdir()] == []  # no staging left behind


def test_unwritable_cache_fails_before_converting(fake_gguf, tmp_path, monkeypatch):
    path, conversions = fake_gguf
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DDTREE_CACHE", str(blocker / "cache"))
    with pytest.raises(ConfigError, match="the model cache .* cannot be written .*set DDTREE_CACHE to a writable"):
        ddtree.load(target=path)
    assert not conversions  # refused before the (slow) conversion, not after it


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_cache_fails_before_converting(fake_gguf, tmp_path, monkeypatch):
    path, conversions = fake_gguf
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o500)
    monkeypatch.setenv("DDTREE_CACHE", str(cache))
    try:
        with pytest.raises(ConfigError, match="cannot be written"):
            ddtree.load(target=path)
    finally:
        cache.chmod(0o700)
    assert not conversions


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_generate_json_is_json_on_a_first_run(fake_gguf, capsys):
    """The first run converts the GGUF: that notice goes to stderr, stdout stays one JSON object."""
    from ddtree.cli import main

    path, conversions = fake_gguf
    assert main(["generate", "Hello", "--target", str(path), "--json", "--max-new-tokens", "4", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert len(conversions) == 1 and "converting tiny.Q4.gguf" in err
    assert len(json.loads(out)["token_ids"]) == 4


# --- the command lines: one table of bad inputs, each refused with exit status 2 and a message -------------
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


@pytest.mark.parametrize("line,message", [
    ('{"turns": "abc"}', r"p.jsonl:3: expected a string, .*\{\"turns\": \[\"...\", ...\]\}"),  # was read as "a"
    ('{"turns": []}', "p.jsonl:3: expected a string"),
    ('{"prompt": 5}', "p.jsonl:3: expected a string"),
    ('{"prompt": ""}', "p.jsonl:3: the prompt is empty"),  # was found mid-run, after the earlier prompts ran
    ('{"question": "  "}', "p.jsonl:3: the prompt is empty"),
    ('{"prompt": "x",}', r"p.jsonl:3: not valid JSON \(Expecting property name"),
])
def test_bad_benchmark_prompt_file(tmp_path, line, message):
    from ddtree.datasets import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + '\n{"turns": ["also fine", "second turn"]}\n')
    with pytest.raises(ConfigError, match=message):
        load_prompts(str(path), 1)  # the whole file is checked up front, not only the prompts asked for


def test_a_dataset_path_that_does_not_exist(tmp_path):
    """Reported as a missing file, not as an unknown dataset name."""
    from ddtree.datasets import load_prompts

    with pytest.raises(ConfigError, match="dataset file .*nope.jsonl' does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"), 1)
    with pytest.raises(ConfigError, match="unknown dataset 'humaneva'"):
        load_prompts("humaneva", 1)


def test_good_benchmark_prompt_file(tmp_path):
    from ddtree.datasets import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n{"prompt": "a"}\n{"turns": ["b", "c"]}\n{"question": "d"}\n')
    assert load_prompts(str(path), 9) == ["plain", "a", "b", "d"]
