"""Files the project writes and reads, handled so that bad input cannot destroy work or hide a problem:
output directories checked before any work starts and JSON Lines whose errors name the file and line
(directories replaced whole and the cache's checksums: ddtree/base/cache.py)."""
from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

from .config import ConfigError


def output_dir(path, what: str, fix: str = "choose another path") -> Path:
    """The directory `path` (created if needed), or a ConfigError before any work is done when it is a file
    or cannot be written. `what` names it in the message (e.g. "--out"), `fix` says what to do instead."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a directory: {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # really writable? (os.access says yes to root on a read-only mount)
            pass
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be written ({e.strerror or e}): {fix}") from None
    return path


def output_file(path, what: str, fix: str = "choose another path") -> Path:
    """The file `path` that a command writes at its end, checked before any work is done (its folder made and
    writable, the path not a directory, an existing file writable): a ConfigError otherwise, as output_dir's.
    An existing file is left as it is."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a file: {fix}")
    output_dir(path.parent, f"the folder of {what}", fix)
    if path.exists():
        try:
            with open(path, "r+b"):  # writable? (opened without truncating)
                pass
        except OSError as e:
            raise ConfigError(f"{what} {path} cannot be written ({e.strerror or e}): {fix}") from None
    return path


def read_jsonl(path, fix: str = "") -> list[tuple[int, object]]:
    """(line number, value) for every non-blank line of a JSONL (or .jsonl.gz) file; a ConfigError naming the
    file and line for one that is not JSON, followed by `fix` (what to do about it) when given."""
    fix = f"; {fix}" if fix else ""
    path = Path(path)
    out = []
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
        else:
            lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}){fix}") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno}){fix}") from None
    return out
