"""Hugging Face hub ids for `target=` and `draft=`: a string that is not an existing path but reads as a repo id
("org/name", optionally "org/name@revision") is resolved to a local snapshot folder through `huggingface_hub`
(which transformers depends on), as vLLM, SGLang and transformers take model ids.

The hub client's own settings are honoured, read when a model is loaded (not when Python started): the cache
folder (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), offline mode (HF_HUB_OFFLINE=1 or
TRANSFORMERS_OFFLINE=1: the cache only, no network), the token (HF_TOKEN or `hf auth login`) and the endpoint
(HF_ENDPOINT). Online, a missing or stale snapshot is downloaded (weights in safetensors, configs, tokenizer
files; not other weight formats); a snapshot already cached for a commit is not fetched again."""
from __future__ import annotations

import os
import re
from pathlib import Path

from .config import ConfigError

# "org/name" with the characters the hub allows; "@revision" (a branch, tag or commit) optional. Single-part ids
# ("gpt2") are not taken: such a string is far more often a mistyped local folder than a hub model.
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+))?$")
# What a target or drafter needs from a repository: configs, safetensors weights, tokenizer and chat template.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
_TRUE = {"1", "on", "yes", "true"}


def hub_cache_dir() -> Path:
    """The hub cache folder, from the environment as it is now (huggingface_hub reads it once, at import)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE as they are set now (or as huggingface_hub read them at import)."""
    if any(os.environ.get(n, "").strip().lower() in _TRUE for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def parse_repo_id(value) -> tuple[str, str | None] | None:
    """(repo id, revision or None) where `value` is a string that reads as a hub id and is not an existing path;
    None otherwise (a path, None, or a string that is neither)."""
    if not isinstance(value, str) or Path(value).expanduser().exists():
        return None
    match = _REPO_ID.match(value.strip())
    if match is None or ".." in value or "--" in match["repo"] or match["repo"].endswith((".gguf", ".safetensors")):
        return None
    return match["repo"], match["revision"]


def resolve(value, role: str = "target", revision: str | None = None):
    """`value` itself where it is not a hub id (an existing path, None, or a string load() reports as a missing
    path); else the local snapshot folder (a Path) of that repository at `revision` (or the id's "@revision", or
    main). role ("target" or "draft") only names it in errors."""
    parsed = parse_repo_id(value)
    if parsed is None:
        return value
    repo, rev = parsed
    rev = revision or rev
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ConfigError(f"{role} {value!r} is not an existing path, and huggingface_hub (to read it as a hub id) "
                          "is not installed: `pip install huggingface_hub`") from None
    cache = hub_cache_dir()
    off = offline()
    at = f" at revision {rev!r}" if rev else ""
    try:
        folder = snapshot_download(repo, revision=rev, cache_dir=str(cache), local_files_only=off,
                                   allow_patterns=ALLOW_PATTERNS)
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ConfigError(f"{role} {value!r} is not an existing path, and the Hugging Face hub has no model "
                          f"{repo!r} that this machine may read ({type(e).__name__}). Check the id, or for a gated "
                          "or private model log in (`hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{role} {value!r}: the hub model {repo!r} has no revision {rev!r}") from None
    except (LocalEntryNotFoundError, OSError) as e:  # not cached, and offline or the hub unreachable
        how = ("offline mode is on (HF_HUB_OFFLINE=1)" if off else
               f"the hub could not be reached ({type(e).__name__})")
        fix = ("download it once with network access (`hf download " + repo + (f" --revision {rev}" if rev else "")
               + "`" + (", or unset HF_HUB_OFFLINE" if off else "") + "), point HF_HUB_CACHE (or HF_HOME) at a "
               "cache that holds it, or pass a local path")
        raise ConfigError(f"{role} {value!r} is not an existing path nor a cached hub model: {repo!r}{at} is not "
                          f"in the hub cache {cache}, and {how}. Fix: {fix}") from None
    except Exception as e:  # noqa: BLE001 - the hub client raises many types (HTTP errors, bad ids, ...)
        raise ConfigError(f"{role} {value!r}: cannot get the hub model {repo!r}{at} into {cache} "
                          f"({type(e).__name__}: {e})") from None
    return Path(folder)
