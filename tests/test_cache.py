"""The cache layer (ddtree/base/cache.py): where the cache is, staging entries of stopped processes swept, sealed
entries verified, write failures that name the problem and the fix, build locks."""
import errno
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ddtree.base import cache
from ddtree.base.config import ConfigError


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cache_root_expands_home_and_ignores_an_empty_value(monkeypatch, tmp_path):
    """DDTREE_CACHE='~/x' made a literal ./~ folder (and converted again); an empty value wrote into the
    current folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDTREE_CACHE", "~/x")
    assert cache.cache_root() == tmp_path / "x"
    monkeypatch.setenv("DDTREE_CACHE", "")
    assert cache.cache_root() == Path.home() / ".cache" / "ddtree"


def test_sweep_removes_the_staging_of_stopped_processes_only(tmp_path, capsys):
    host, dead = socket.gethostname(), dead_pid()
    gone = [tmp_path / f".model-abc.tmp{dead}", tmp_path / f".model-abc.3.tmp-{host}-{dead}",
            tmp_path / f"curve.json.{dead}.tmp"]
    kept = [tmp_path / f".model-abc.tmp-{host}-{os.getpid()}", tmp_path / f".model-abc.tmp-{host}-1",  # alive
            tmp_path / f".model-abc.tmp-otherhost-{dead}", tmp_path / "model-abc"]  # another host's; an entry
    for p in gone[:2] + kept:
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x" * 100)
    gone[2].write_text("{")
    assert sorted(cache.sweep(tmp_path)) == sorted(gone)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in gone)
    assert "removed 3 unfinished cache entries" in capsys.readouterr().err


def test_verify_finds_a_same_size_change_and_skips_hashing_an_untouched_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "STAMP_SETTLE_NS", -1)
    (tmp_path / "blocks.bin").write_bytes(bytes(range(256)))
    cache.seal(tmp_path, key="k")
    hashed = []
    real = cache.checksum
    monkeypatch.setattr(cache, "checksum", lambda p: hashed.append(p) or real(p))
    assert cache.verify(tmp_path, required=("blocks.bin",)) == [] and not hashed  # stamps match: no hashing
    data = bytearray((tmp_path / "blocks.bin").read_bytes())
    data[7] ^= 1
    (tmp_path / "blocks.bin").write_bytes(bytes(data))
    assert cache.verify(tmp_path) == ["blocks.bin has changed"]
    assert cache.verify(tmp_path, required=("other.bin",)) == [f"{cache.CACHE_MANIFEST} lists no other.bin"]
    (tmp_path / cache.CACHE_MANIFEST).unlink()
    assert "no readable" in cache.verify(tmp_path)[0]


@pytest.mark.parametrize("code, problem", [(errno.ENOSPC, "the disk is full"),
                                           (errno.EROFS, "the folder is read-only"),
                                           (errno.EACCES, "the folder is read-only")])
def test_a_failed_write_names_the_problem_and_the_fix(tmp_path, code, problem):
    dest = tmp_path / "entry"
    dest.mkdir()
    (dest / "old").write_text("kept")
    with pytest.raises(ConfigError, match=f"cannot write the thing in .*: {problem}; .*DDTREE_CACHE"):
        with cache.replacing_dir(dest, "the thing") as tmp:
            (tmp / "new").write_text("half")
            raise OSError(code, os.strerror(code))
    assert [p.name for p in tmp_path.iterdir()] == ["entry"] and (dest / "old").read_text() == "kept"
    # safetensors reports a full disk as its own error type, with the OS error in its text
    wrapped = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                           'space left on device" })')
    assert "the disk is full" in str(cache.write_error(wrapped, dest, "the thing"))
    assert cache.write_error(RuntimeError("a bug"), dest, "the thing") is None


def test_a_stale_lock_is_removed_and_a_live_one_waited_for(tmp_path, capsys, monkeypatch):
    lock = tmp_path / "build.lock"
    lock.write_text(f"{socket.gethostname()} {dead_pid()}\n")
    with cache.build_lock(lock, "the thing"):
        assert lock.read_text().split() == [socket.gethostname(), str(os.getpid())]
    assert not lock.exists() and "removing the stale lock" in capsys.readouterr().err
    monkeypatch.setattr(cache, "LOCK_POLL_S", 0.01)
    lock.write_text(f"{socket.gethostname()} {os.getpid()}\n")  # a live owner
    entered = threading.Event()

    def take():
        with cache.build_lock(lock, "the thing"):
            entered.set()

    worker = threading.Thread(target=take, daemon=True)
    worker.start()
    assert not entered.wait(0.3)  # waits while its owner lives
    lock.unlink()  # the owner finished
    assert entered.wait(10)
    assert "waiting for process" in capsys.readouterr().err


def test_a_users_folder_is_never_swept(tmp_path):
    """replacing_dir without a cache entry's name (an --out folder) leaves files that only look like staging."""
    mine = tmp_path / f"notes.{dead_pid()}.tmp"
    mine.write_text("the user's")
    with cache.replacing_dir(tmp_path / "out") as tmp:
        (tmp / "drafter.safetensors").write_text("x")
    assert mine.exists() and (tmp_path / "out" / "drafter.safetensors").exists()
