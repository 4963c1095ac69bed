"""Loading (ddtree/models/loading.py): the default dtype, devices and dtypes checked before the load, target and
drafter files that do not match, and the dequantized GGUF cache (checksummed at conversion, verified on load)."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ddtree.base.cache import checksum
from ddtree.base.config import ConfigError
from ddtree.models.loading import default_dtype, resolve_target_dir, verify_cache
import ddtree
from ddtree.bench.testing import add_markov_head, char_tokenizer, random_pair, save_target


@pytest.mark.parametrize("amx, avx512_bf16", [
    (True, True),     # Sapphire Rapids-class Xeon: AMX tiles, yet bf16 runs without the float32 CPU runtime
    (False, True),    # AVX512-BF16 without AMX: the float32 path measured faster
    (False, False),   # AVX2 only: bf16 emulated
])
def test_cpu_default_dtype_is_float32_whatever_the_bf16_units(monkeypatch, amx, avx512_bf16):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert default_dtype(torch.device("cpu")) is torch.float32


def test_cuda_default_dtype_is_bf16():
    assert default_dtype(torch.device("cuda")) is torch.bfloat16


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
    drafter.model.save(tmp_path / "drafter")
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


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf path whose "dequantization" is a tiny seeded model (the real one takes ~20 s), in a private
    DDTREE_CACHE. Returns (path, list of conversions done)."""
    from ddtree.models import loading
    from ddtree.bench.hf_baseline import to_hf_model

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
    from ddtree.base import cache

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

    from ddtree.models.loading import gguf_cache_dir

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


def test_the_same_gguf_bytes_elsewhere_share_one_conversion(fake_gguf, tmp_path):
    """Every virtual environment holds its own copy of the embedded wheel's GGUF: keyed by path, each had added a
    538 MB conversion until the disk was full. Keyed by content, a copy finds the first one; other bytes do not."""
    path, conversions = fake_gguf
    first = _cached(fake_gguf)
    copy = tmp_path / "other-venv" / path.name
    copy.parent.mkdir()
    shutil.copy2(path, copy)
    assert resolve_target_dir(copy) == first and len(conversions) == 1
    copy.write_bytes(b"GGUF, other bytes")
    assert resolve_target_dir(copy) != first and len(conversions) == 2


def test_outdated_conversions_whose_source_is_gone_are_removed(fake_gguf, tmp_path):
    """Older-format conversions (keyed by path) of a file that no longer exists are removed with their exact
    blocks; one whose source still exists, one of another name and an unsealed folder stay."""
    from ddtree.base.cache import cache_root, seal

    path, _ = fake_gguf
    root = cache_root()

    def old_conversion(name, source):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        seal(folder, format=3, source={"path": str(source), "size": 4, "mtime_ns": 0})
        return folder

    gone = old_conversion(f"{path.stem}-0123456789ab", tmp_path / "deleted-venv" / path.name)
    (root / "exact-blocks" / gone.name).mkdir(parents=True)
    (root / "exact-blocks" / gone.name / "blocks.safetensors").write_bytes(b"y")
    alive = old_conversion(f"{path.stem}-ba9876543210", path)
    other = old_conversion("another-0123456789ab", tmp_path / "deleted-venv" / "another.gguf")
    unsealed = root / f"{path.stem}-aaaaaaaaaaaa"
    unsealed.mkdir()
    _cached(fake_gguf)
    assert not gone.exists() and not (root / "exact-blocks" / gone.name).exists()
    assert alive.exists() and other.exists() and unsealed.exists()


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


@pytest.mark.slow
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


def test_a_drafters_markov_head_is_used_when_asked(model_dirs, tmp_path, monkeypatch):
    target_dir, _ = model_dirs
    target, drafter = random_pair("llama", seed=1, num_draft_layers=2)
    add_markov_head(drafter, rank=4, seed=2)
    drafter.model.save(tmp_path / "with-head")
    off = ddtree.load(target=target_dir, draft=tmp_path / "with-head")  # by default: the marginals, as published
    assert off.drafter.markov is None and off.drafter.cfg.markov is None
    on = ddtree.load(target=target_dir, draft=tmp_path / "with-head", markov_head=True)
    assert on.drafter.markov is not None and on.drafter.cfg.markov == (4, 32)
    assert on.drafter.label.endswith("+ Markov head")
    monkeypatch.setenv("DDTREE_MARKOV_HEAD", "1")  # where the argument is not given
    assert ddtree.load(target=target_dir, draft=tmp_path / "with-head").drafter.markov is not None
    assert ddtree.load(target=target_dir, draft=tmp_path / "with-head", markov_head=False).drafter.markov is None
    monkeypatch.setenv("DDTREE_MARKOV_HEAD", "0")  # the argument beats the environment
    assert ddtree.load(target=target_dir, draft=tmp_path / "with-head", markov_head=True).drafter.markov is not None
    assert ddtree.load(target=target_dir, draft=tmp_path / "with-head").drafter.markov is None
    monkeypatch.delenv("DDTREE_MARKOV_HEAD")
    with pytest.raises(ConfigError, match="markov_head must be True or False"):
        ddtree.load(target=target_dir, markov_head="no")
    _edit_json(tmp_path / "with-head" / "config.json", markov_head={"rank": 4})
    with pytest.raises(ConfigError, match=r"markov_head must be \{\"rank\": r, \"candidates\": M\}"):
        ddtree.load(target=target_dir, draft=tmp_path / "with-head")
    _edit_json(tmp_path / "with-head" / "config.json", markov_head={"rank": 0, "candidates": 8})
    with pytest.raises(ConfigError, match="markov_head needs positive integers"):
        ddtree.load(target=target_dir, draft=tmp_path / "with-head")


CONFIG_CASES = [  # (which config.json, changes, message): each refused before a tensor is built or a weight read
    ("target", {"hidden_size": 64.0}, r"config field hidden_size must be an integer, got 64.0 \(float\): restore the "
                                      r"config.json that came with the weights"),
    ("target", {"vocab_size": "96"}, r"config field vocab_size must be an integer, got '96' \(str\)"),
    ("target", {"num_hidden_layers": 300}, r"num_hidden_layers=300, and the weights hold 6 layers: restore"),
    ("target", {"intermediate_size": 10**9}, r"config field intermediate_size must be within 1\.\.1048576, got "
                                             r"1000000000: restore"),
    ("target", {"rope_theta": "big"}, r"config field rope_theta must be a positive number, got 'big'"),
    ("drafter", {"hidden_size": 64.0}, r"drafter .*config field hidden_size must be an integer, got 64.0"),
    ("drafter", {"num_hidden_layers": 300}, r"num_hidden_layers=300, and the weights hold 2 layers: restore"),
    ("drafter", {"intermediate_size": 1 << 20}, r"mlp.gate_proj.weight is \[128, 64\] in the weights but "
                                                r"\[1048576, 64\] by config.json"),
    ("drafter", {"intermediate_size": 10**9}, r"config field intermediate_size must be within 1\.\.1048576"),
    ("drafter", {"block_size": 8.0}, r"config field block_size must be an integer, got 8.0"),
    ("drafter", {"num_target_layers": "6"}, r"config field num_target_layers must be an integer, got '6'"),
    ("drafter", {"markov_head": {"rank": 10**6, "candidates": 32}},
     r"config field markov_head.rank must be within 1\.\.64, got 1000000: restore"),
]


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
@pytest.mark.parametrize("which,changes,message", CONFIG_CASES)
def test_config_sizes_are_checked_before_anything_is_allocated(model_dirs, monkeypatch, which, changes, message):
    """Sizes in a target's or drafter's config.json must be integers, in a sane range and those of the weights'
    header: a float, a string, 300 layers where the file has 2 (or 6), an intermediate_size of 10**9 or a Markov
    rank of 10**6 is a ConfigError naming the field, the value and the fix; every model is built on the meta device
    (no memory), and no weight data is read before the config is found to match its weights."""
    from ddtree.models import drafter as drafter_module, loading

    target_dir, drafter_dir = model_dirs
    _edit_json((target_dir if which == "target" else drafter_dir) / "config.json", **changes)
    built = []
    init = drafter_module.DFlashDrafter.__init__

    def spy(self, *args, **kw):
        init(self, *args, **kw)
        built.append(self.fc.weight.device.type)

    monkeypatch.setattr(drafter_module.DFlashDrafter, "__init__", spy)
    read = loading.read_safetensors

    def no_reads(directory):
        if Path(directory) == Path(target_dir if which == "target" else drafter_dir):
            raise AssertionError(f"the weights of {directory} were read before the config was checked")
        return read(directory)

    monkeypatch.setattr(loading, "read_safetensors", no_reads)
    monkeypatch.setattr(drafter_module, "read_safetensors", no_reads)
    with pytest.raises(ConfigError, match=message):
        ddtree.load(target=target_dir, draft=drafter_dir)
    assert set(built) <= {"meta"}


def test_a_drafter_is_built_on_the_meta_device_and_filled_from_its_file(model_dirs):
    """DFlashDrafter.load builds no random weights: the loaded drafter equals the saved one exactly."""
    from safetensors.torch import load_file

    from ddtree.models.drafter import DFlashDrafter

    _, drafter_dir = model_dirs
    saved = load_file(str(drafter_dir / "model.safetensors"))
    loaded = DFlashDrafter.load(drafter_dir)
    state = loaded.state_dict()
    assert set(state) == set(saved) - {"embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(state[k], saved[k]) for k in state)
    assert loaded.rotary.inv_freq.device.type == "cpu"


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
@pytest.mark.parametrize("text", ['{"eos_token_id": 2,', "[1, 2]", '{"eos_token_id": "</s>"}', "\udcff"])
def test_a_damaged_generation_config_is_refused_with_the_fix(model_dirs, text):
    target_dir, _ = model_dirs
    (target_dir / "generation_config.json").write_text(text, errors="surrogateescape")
    with pytest.raises(ConfigError, match=r"generation_config.json.*restore the file that came with the model, or "
                                          r"delete it"):
        ddtree.load(target=target_dir)


def test_a_load_builds_nothing_on_the_meta_device_that_imports_the_compiler_stack(model_dirs, tmp_path):
    """A target and a drafter with a Markov head are built on the meta device, then filled: a random init or an
    arithmetic op there would import torch._dynamo (~0.3 s, ~90 MB) for values thrown away. In a fresh process,
    after importing what load() imports anyway."""
    import subprocess
    import sys

    target_dir, _ = model_dirs
    _, drafter = random_pair("llama", seed=1, num_draft_layers=2)
    add_markov_head(drafter, rank=4, seed=2)
    drafter.model.save(tmp_path / "with-head")
    code = ("import sys, torch, transformers, ddtree\n"
            "before = 'torch._dynamo' in sys.modules\n"
            f"pair = ddtree.load({str(target_dir)!r}, {str(tmp_path / 'with-head')!r}, cpu_kernel='off', "
            "markov_head=True)\n"
            "from ddtree.models.protocol import reference\n"
            "drafter = reference(pair.drafter)\n"
            "assert drafter.markov is not None and drafter.rotary is not None\n"
            "print('already' if before else 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "already":
        pytest.skip("this torch / transformers imports torch._dynamo by itself")
    assert out.stdout.strip() == "False"
