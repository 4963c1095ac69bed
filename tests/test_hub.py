"""Hugging Face hub ids for target= and draft= (ddtree/base/hub.py), offline against a hub-cache layout built here
(models--org--name/blobs, snapshots/<commit>/..., refs/main): no network is used."""
import hashlib
import os
from pathlib import Path

import pytest

import ddtree
from ddtree.base import hub
from ddtree.base.config import ConfigError
from ddtree.bench.testing import char_tokenizer, random_pair, save_target


def hub_snapshot(cache: Path, repo: str, files: Path, commit: str | None = None, ref: str = "main",
                 link: bool = False) -> Path:
    """Lay out `files` (a folder) in `cache` as huggingface_hub stores a download: blobs named by content,
    snapshots/<commit>/<name> linking to them, refs/<ref> naming the commit. link=True makes each blob a symbolic
    link to the original file (no copy of a large model)."""
    commit = commit or hashlib.sha1(repo.encode()).hexdigest()
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(files.iterdir()):
        blob = root / "blobs" / hashlib.sha256(f"{f.name}:{f.stat().st_size}".encode()).hexdigest()
        if not blob.exists():
            if link:
                blob.symlink_to(f.resolve())
            else:
                blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # "org/name" must not exist as a relative folder
    return cache


@pytest.fixture
def tiny_repos(tmp_path, offline_cache):
    """A tiny target (with a character tokenizer) and its drafter, as the cached hub models org/tiny and
    org/tiny-dflash."""
    target, drafter = random_pair("llama", seed=3, num_draft_layers=1)
    save_target(target, tmp_path / "files-target", char_tokenizer())
    drafter.model.save(tmp_path / "files-draft")
    hub_snapshot(offline_cache, "org/tiny", tmp_path / "files-target")
    hub_snapshot(offline_cache, "org/tiny-dflash", tmp_path / "files-draft")
    return target, drafter


def test_paths_and_non_ids_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert hub.resolve(None) is None
    assert hub.resolve("org/local") == "org/local"  # an existing relative folder is a path, not an id
    assert hub.resolve(tmp_path) == tmp_path
    for value in ("/abs/missing", "./rel/missing", "gpt2", "model.gguf", "org/model.gguf", "a/b/c", "org/../x"):
        assert hub.parse_repo_id(value) is None, value
    assert hub.parse_repo_id("z-lab/Qwen3-8B-DFlash-b16") == ("z-lab/Qwen3-8B-DFlash-b16", None)
    assert hub.parse_repo_id("org/name@v1.0") == ("org/name", "v1.0")


def test_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.hub_cache_dir() == tmp_path / "c"


@pytest.mark.filterwarnings("ignore:ddtree. no trained drafter")
def test_hub_ids_load_offline_from_the_cache(tiny_repos, offline_cache):
    target, _ = tiny_repos
    pair = ddtree.load(target="org/tiny", draft="org/tiny-dflash")
    assert pair.name == "org/tiny" and pair.drafter.label == "org/tiny-dflash"
    assert pair.target.cfg.hidden_size == target.cfg.hidden_size
    ar = pair.generate("hello", method="ar", max_new_tokens=12, chat=False)
    tree = pair.generate("hello", method="ddtree", budget=8, max_new_tokens=12, chat=False)
    assert tree.token_ids == ar.token_ids and ar.token_ids
    # the folder is the snapshot the ref names, inside the cache the environment gives
    assert hub.resolve("org/tiny", "target").parents[1] == offline_cache / "models--org--tiny"


def test_revisions_resolve_to_their_own_snapshot(tmp_path, offline_cache):
    files = tmp_path / "files"
    files.mkdir()
    (files / "config.json").write_text("{}")
    old = hub_snapshot(offline_cache, "org/rev", files, commit="a" * 40, ref="v1")
    new = hub_snapshot(offline_cache, "org/rev", files, commit="b" * 40, ref="main")
    assert hub.resolve("org/rev") == new
    assert hub.resolve("org/rev@v1") == old
    assert hub.resolve("org/rev", revision="v1") == old
    assert hub.resolve("org/rev", revision="a" * 40) == old  # a commit hash needs no ref


def test_offline_and_not_cached_names_the_id_the_cache_and_the_fix(offline_cache):
    with pytest.raises(ConfigError) as e:
        ddtree.load(target="org/not-cached")
    text = str(e.value)
    assert "'org/not-cached'" in text and str(offline_cache) in text and "HF_HUB_OFFLINE" in text
    assert "hf download org/not-cached" in text and "local path" in text
    with pytest.raises(ConfigError, match=r"draft 'org/no-drafter'.*hf download org/no-drafter"):
        hub.resolve("org/no-drafter", "draft")
    with pytest.raises(ConfigError, match="revision 'v9'"):
        hub.resolve("org/not-cached@v9")


def test_a_missing_local_path_still_says_so(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ddtree.load(target=str(tmp_path / "nope"))


@pytest.mark.real_model
def test_the_embedded_model_from_a_hub_cache(tmp_path, offline_cache):
    """The embedded pair's files (the converted target, the shipped drafter) as cached hub models: loaded by id,
    decoded losslessly."""
    from ddtree.models.loading import SHIPPED_DRAFTER, resolve_target_dir

    hub_snapshot(offline_cache, "HuggingFaceTB/SmolLM2-135M-Instruct",
                 Path(resolve_target_dir(None)), link=True)
    hub_snapshot(offline_cache, "ddtree/smollm2-135m-dflash", SHIPPED_DRAFTER, link=True)
    pair = ddtree.load(target="HuggingFaceTB/SmolLM2-135M-Instruct", draft="ddtree/smollm2-135m-dflash")
    assert pair.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    ar = pair.generate("What is 2+2?", method="ar", max_new_tokens=16)
    tree = pair.generate("What is 2+2?", method="ddtree", budget=16, max_new_tokens=16)
    assert tree.token_ids == ar.token_ids and tree.stats.tau > 1
