"""The cache layer every file the project keeps under $DDTREE_CACHE goes through (the converted models, the exact
blocks, the compiled CPU kernels, the verify-cost curves):

- written under a staging name beside its place (`.<name>.tmp-<host>-<pid>`) and renamed into it whole, so a
  reader never sees half a file, and a killed writer leaves only a staging entry, swept by the next writer once
  its owner process is gone (sweep);
- sealed with a manifest (CACHE_MANIFEST) of its files' SHA-256 taken at write, and verified before use: the
  files are hashed again only when their stat stamps differ from those recorded when they were last found
  intact, so a load of an untouched entry costs a few stat calls (verify);
- a failure to write (a full disk, a read-only folder) is a ConfigError that names the problem and the fix
  (write_error);
- builds that take a while (the kernels) hold a lock naming their process; a lock whose process is gone is
  removed, a live one is waited for with a notice (build_lock).
"""
from __future__ import annotations

import errno
import functools
import hashlib
import importlib.machinery
import importlib.util
import itertools
import json
import mmap
import os
import re
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .config import ConfigError
from .knobs import env_path

CACHE_MANIFEST = "ddtree-cache.json"
STAMP_SETTLE_NS = 2_000_000_000
FIX = "set DDTREE_CACHE to a writable folder with free space"
# A staging entry: `.<name>.tmp<pid>`, `.<name>.old<pid>` (before this layer) or `.<name>.<n>.tmp-<host>-<pid>`,
# and single files `<name>.<pid>.tmp`.
STAGING = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)(?:-(?P<host>.+)-)?(?P<pid>\d+)$|^(?P<file>.+)\.(?P<fpid>\d+)\.tmp$")
LOCK_POLL_S = 0.5
_staged = itertools.count()


def cache_root() -> Path:
    """$DDTREE_CACHE (`~` expanded; empty means unset), else ~/.cache/ddtree."""
    return env_path("DDTREE_CACHE", Path.home() / ".cache" / "ddtree")


def notice(message: str) -> None:
    print(f"ddtree: {message}", file=sys.stderr, flush=True)


# --- checksums ----------------------------------------------------------------------------------------------
def checksum(path) -> str:
    """SHA-256 of a file's bytes, hashed from a memory map (no copy)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return hashlib.sha256(b"").hexdigest()  # an empty file cannot be mapped
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=64)
def _content_key(path: str, stamp: tuple) -> str:
    return checksum(path)


def content_key(path) -> str:
    """SHA-256 of a source file's bytes, computed once per process and file version (it reads the whole file): what
    keys a cache entry derived from the file, so that the same file in another place (another virtual
    environment's copy of a wheel) finds the entry instead of adding one."""
    stamp = stat_stamp(path)
    if stamp is None:
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
    return _content_key(str(Path(path).resolve()), tuple(stamp))


def stat_stamp(path) -> list[int] | None:
    """What changes whenever a file's bytes are changed through the filesystem: size, mtime, ctime (which no
    tool can set back) and inode. None for a missing file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def read_manifest(directory: Path) -> dict | None:
    try:
        manifest = json.loads((Path(directory) / CACHE_MANIFEST).read_text())
        return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None
    except (OSError, ValueError):
        return None


def seal(directory: Path, files=None, **meta) -> dict:
    """Write the manifest of `directory`: the SHA-256 of `files` (names; default: every file in it) and `meta`."""
    directory = Path(directory)
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != CACHE_MANIFEST) \
        if files is None else list(files)
    manifest = {**meta, "files": {name: checksum(directory / name) for name in names}}
    _write_manifest(directory, manifest)
    return manifest


def verify(directory: Path, required=()) -> list[str]:
    """What is wrong with a sealed cache entry (empty: nothing): no manifest, a `required` file not listed, a
    listed file missing or with other bytes than at write. Files are hashed only where their stat stamps differ
    from those recorded when they were last found intact; any write to a file changes its ctime."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"no readable {CACHE_MANIFEST}: an interrupted write or an older version's entry"]
    files = manifest["files"]
    if missing := [name for name in required if name not in files]:
        return [f"{CACHE_MANIFEST} lists no {', '.join(missing)}"]
    stamps = {name: stat_stamp(directory / name) for name in files}
    if all(stamps.values()) and manifest.get("stamps") == stamps:
        return []
    problems = [f"{name} is missing" if stamps[name] is None else f"{name} has changed"
                for name, digest in files.items() if stamps[name] is None or checksum(directory / name) != digest]
    if not problems:
        try:  # intact: remember these stamps, so the next load need not hash again
            _write_manifest(directory, manifest)
        except OSError:  # a read-only cache: verified by hash on every load
            pass
    return problems


def _write_manifest(directory: Path, manifest: dict) -> None:
    """The manifest with the current stat stamps of its files (taken after they were hashed). A stamp younger
    than STAMP_SETTLE_NS is not recorded: file times tick coarsely (~4 ms), so a write right after it could
    leave it unchanged (git's "racy clean" problem); that file is hashed again on the next load instead."""
    now = time.time_ns()
    stamps = {name: stat_stamp(directory / name) for name in manifest["files"]}
    manifest = {**manifest, "stamps": {name: st if st and now - max(st[1], st[2]) > STAMP_SETTLE_NS else None
                                       for name, st in stamps.items()}}
    write_bytes(directory / CACHE_MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def digest_json(data) -> str:
    """SHA-256 of a JSON value in its canonical form (sorted keys): the checksum of a one-file entry."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# --- writing ------------------------------------------------------------------------------------------------
def write_error(e: BaseException, path, what: str) -> ConfigError | None:
    """A ConfigError naming the problem and the fix for a failed write of `what` at `path`, or None where `e`
    is not a file-system failure. Also reads the text of errors that wrap one (safetensors' `IoError(Os {code})`)."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        found = re.search(r"code: (\d+)", str(e)) or re.search(r"\[Errno (\d+)\]", str(e))
        code = int(found.group(1)) if found else None
    if code in (errno.ENOSPC, errno.EDQUOT):
        problem = "the disk is full"
        fix = f"free some space (or delete {cache_root()}, which is rebuilt on demand), or {FIX}"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        problem = "the folder is read-only"
        fix = FIX
    elif isinstance(e, OSError):
        problem, fix = e.strerror or str(e), FIX
    else:
        return None
    return ConfigError(f"cannot write {what} in {path}: {problem}; {fix}")


def staging_path(dest: Path) -> Path:
    """A sibling of `dest` (same file system: atomic renames) that names this host and process, and is new on
    every call (torch's extension loader takes a build folder it has built in before for the same build)."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{next(_staged)}.tmp-{socket.gethostname()}-{os.getpid()}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or a number no pid can be: kept, never guessed at)
    return True


def sweep(folder: Path) -> list[Path]:
    """Delete the staging entries in `folder` whose owner process (on this host) is gone; returns them."""
    swept = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return swept
    host = socket.gethostname()
    for entry in entries:
        found = STAGING.match(entry.name)
        if not found or found["host"] not in (None, host):
            continue
        pid = int(found["pid"] or found["fpid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            swept.append(entry)
        except OSError:
            pass  # a read-only cache: left as it is
    if swept:
        notice(f"removed {len(swept)} unfinished cache entr{'y' if len(swept) == 1 else 'ies'} left by a stopped "
               f"process in {folder}")
    return swept


@contextmanager
def replacing_dir(dest: Path, what: str | None = None):
    """Yields an empty staging directory beside `dest` to write into; when the block ends normally the staging
    directory replaces `dest`, else it is deleted and `dest` stays as it was. What was at `dest` is moved aside
    first and deleted only once the new one is in place, so `dest` is never a mix of old and new files. With
    `what` (the name of a cache entry), leftover staging of stopped processes beside it is swept first (only in
    the cache: a user's folder is never swept), and a failed write is a ConfigError naming the problem and the fix."""
    dest = Path(dest)
    tmp = staging_path(dest)
    old = tmp.with_name(tmp.name.replace(".tmp-", ".old-", 1))
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if what:
            sweep(dest.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise (write_error(e, dest.parent, what) if what else e) from e
    try:
        yield tmp
        if dest.exists():
            os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except OSError:
            if old.exists():
                os.replace(old, dest)
            raise
    except Exception as e:
        error = write_error(e, dest, what) if what else None
        if error is None:
            raise
        raise error from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)  # only now: the new directory is in place


def write_bytes(path: Path, data: bytes) -> None:
    """`data` as the file `path`, written under a staging name and renamed: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# --- builds -------------------------------------------------------------------------------------------------
def _lock_owner(lock: Path) -> tuple[str, int] | None:
    try:
        host, pid = lock.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


@contextmanager
def build_lock(lock: Path, what: str, wait: bool = True):
    """Hold the file `lock` (it names this host and process) while building `what`. A lock left by a stopped
    process is removed; a live owner's is waited for, with a notice naming it (wait=False: refused with a
    ConfigError naming it instead)."""
    lock = Path(lock)
    waiting = False
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            owner = _lock_owner(lock)
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                continue
            # No owner recorded: a writer stopped between creating the lock and naming itself (a second at most).
            stale = owner[0] == socket.gethostname() and not pid_alive(owner[1]) if owner else age > 10
            if stale:
                notice(f"removing the stale lock {lock} (its process {owner[1] if owner else '?'} is gone)")
                try:
                    lock.unlink()
                except FileNotFoundError:
                    pass
                continue
            if not wait:
                raise ConfigError(f"{what} is in use by process {owner[1] if owner else '?'} on "
                                  f"{owner[0] if owner else 'this host'} (its lock: {lock}); wait for it to finish or "
                                  "choose another folder (if no such process runs, delete the lock)")
            if not waiting:
                notice(f"waiting for process {owner[1] if owner else '?'} on {owner[0] if owner else 'this host'}, "
                       f"which is building {what} (if no such process runs, delete {lock})")
                waiting = True
            time.sleep(LOCK_POLL_S)
        except OSError as e:
            raise write_error(e, lock.parent, what) from e
    try:
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        os.close(fd)
        yield
    finally:
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


def import_library(path: Path, name: str):
    """The Python extension module in the compiled library `path` (verify its entry before calling this: a
    damaged library must never be loaded, it can crash the process)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
