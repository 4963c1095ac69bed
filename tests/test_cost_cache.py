"""The adaptive budget's verify-cost curve: measured once per machine/target/dtype/threads, kept on disk."""
import errno
import json

import pytest
import torch

from ddtree.engine import cost_cache
from ddtree.api import Pair
from ddtree.engine.budget import CostModel
from ddtree.base.cache import digest_json
from ddtree.bench.testing import random_pair


class Meter:
    """A LoadMeter stand-in: `busy` cores used by other processes during every lap."""
    busy = 0.0

    def lap(self):
        return self.busy


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(cost_cache, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(cost_cache, "_measured", {})
    monkeypatch.setattr(cost_cache, "LoadMeter", Meter)  # a quiet machine, whatever this one is doing
    return tmp_path


@pytest.fixture
def counted(monkeypatch):
    """Count calibrate() calls (returning a fixed curve: the timings themselves are not the point here)."""
    calls = []

    def fake(target, drafter, sizes, block_size):
        calls.append(sizes)
        return CostModel(sizes[:3], (0.01, 0.011, 0.012), 0.002, context=256, key_seconds=(1e-6, 2e-6))

    monkeypatch.setattr(cost_cache, "calibrate", fake)
    return calls


def test_measured_once_then_read_from_disk(folder, counted, monkeypatch):
    target, drafter = random_pair("llama", seed=5, block_size=8)
    cost = cost_cache.verify_costs(target, drafter, 8, 257)
    assert len(counted) == 1 and counted[0][-1] == 257
    files = list(folder.glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["key"] == cost_cache.cost_key(target, drafter, 8, 257)  # the key travels with the curve
    assert stored["key"]["threads"] == torch.get_num_threads() and stored["key"]["dtype"] == "float32"
    assert stored["key"]["machine"] == cost_cache.machine_name("cpu")
    assert cost_cache.verify_costs(target, drafter, 8, 257) is cost  # this process: no file read
    monkeypatch.setattr(cost_cache, "_measured", {})  # a new process
    read = cost_cache.verify_costs(target, drafter, 8, 257)
    assert read == cost and len(counted) == 1
    assert read.context == 256 and read.key_seconds == (1e-6, 2e-6)  # the context model travels too


def test_another_configuration_measures_again(folder, counted, monkeypatch):
    target, drafter = random_pair("llama", seed=5, block_size=8)
    cost_cache.verify_costs(target, drafter, 8, 257)
    cost_cache.verify_costs(target, drafter, 4, 257)  # another block size
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # other threads
    cost_cache.verify_costs(target, drafter, 8, 257)
    bf16_target, bf16_drafter = random_pair("llama", seed=5, block_size=8, dtype=torch.bfloat16)
    cost_cache.verify_costs(bf16_target, bf16_drafter, 8, 257)
    assert len(counted) == 4 and len(list(folder.glob("*.json"))) == 4


def test_weights_do_not_matter_their_storage_does(folder, counted):
    """Other values of the same shapes share a curve; a drafter whose CPU passes stream 8-bit blocks or bf16 copies
    (cpu_stack.compact_copy: fewer bytes, cheaper drafts) gets one of its own."""
    from ddtree.runtime.cpu.qlinear import round_po2_q8

    a, da = random_pair("llama", seed=5, block_size=8)
    b, db = random_pair("llama", seed=6, block_size=8)
    assert cost_cache.cost_key(a, da, 8, 257) == cost_cache.cost_key(b, db, 8, 257)
    assert cost_cache.cost_key(a, da, 8, 257)["drafter_storage"] == "float32"
    storages = []
    for rounding in (lambda w: w.bfloat16().float(), round_po2_q8):
        with torch.no_grad():
            for p in db.model.parameters():
                if p.dim() == 2:
                    p.copy_(rounding(p))
        storages.append(cost_cache.cost_key(b, db, 8, 257)["drafter_storage"])
    assert storages == ["bf16", "q8"]


@pytest.mark.parametrize("content", ["{not json", '{"key": {"other": 1}, "sizes": [1], "verify_seconds": [0.1], '
                                                  '"fixed_seconds": 0.0}', '{"key": null}'])
def test_a_bad_or_foreign_file_is_measured_again(folder, counted, content, recwarn):
    target, drafter = random_pair("llama", seed=5, block_size=8)
    key = cost_cache.cost_key(target, drafter, 8, 257)
    path = cost_cache.cost_path(key)
    path.write_text(content)
    cost_cache.verify_costs(target, drafter, 8, 257)
    assert len(counted) == 1 and json.loads(path.read_text())["key"] == key  # replaced


@pytest.mark.slow
def test_auto_uses_the_cache(folder, counted):
    """budget='auto' gets its curve in prepare(), before the timed generation, through the cache."""
    from ddtree.api import Pair

    target, drafter = random_pair("llama", seed=5, block_size=8)
    pair = Pair(target, drafter, None)
    res = pair.generate([1, 2, 3], method="ddtree:auto", max_new_tokens=6)
    assert res.stats.budget == "auto" and len(counted) == 1
    Pair(target, drafter, None).generate([1, 2, 3], method="ddtree:auto", max_new_tokens=6)
    assert len(counted) == 1
    auto = pair.method("ddtree:auto")
    assert auto.budget == auto.cost.sizes[-1] - 1  # trees the calibration stopped short of are never built


def test_the_cpu_layers_have_their_own_curve():
    """The C++ decoder layers (ddtree/runtime/cpu/stack.py) change what a verify costs, and not by one factor: a target
    with them and one without (eager layers) keep separate curves."""
    target, drafter = random_pair("llama", seed=5, block_size=8)
    assert target.stack is not None
    fast = cost_cache.cost_key(target, drafter, 8, 257)
    target.stack = None
    assert fast["cpu_layers"] and cost_cache.cost_key(target, drafter, 8, 257) != fast


def stored_file(folder, counted, edit):
    """A measured curve on disk, changed by `edit(data)` (a dict) and written back."""
    target, drafter = random_pair("llama", seed=5, block_size=8)
    cost_cache.verify_costs(target, drafter, 8, 257)
    path = next(folder.glob("*.json"))
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    cost_cache._measured.clear()  # a new process
    return target, drafter, path


@pytest.mark.parametrize("field", ["verify_seconds", "draft_seconds"])
def test_zero_timings_are_measured_again(folder, counted, capsys, monkeypatch, field):
    """A file with zero (or negative, or infinite) times would divide by zero in budget='auto' (the default):
    noticed and measured again, even with its checksum made to match."""
    monkeypatch.setattr(cost_cache, "calibrate",
                        lambda *a, **k: CostModel((1, 2, 3), (0.01, 0.011, 0.012), 0.002, (0.001, 0.002)))

    def zero(data):
        data[field] = [0.0 for _ in data[field]]
        data.pop("sha256", None)
        data["sha256"] = digest_json(data)

    target, drafter, path = stored_file(folder, counted, zero)
    cost = cost_cache.verify_costs(target, drafter, 8, 257)
    assert all(t > 0 for t in cost.verify_seconds + cost.draft_seconds)
    assert "damaged (a time that is not positive and finite)" in capsys.readouterr().err
    res = Pair(target, drafter, None).generate([1, 2, 3], method="ddtree:auto", max_new_tokens=4)
    assert len(res.token_ids) == 4


def test_a_changed_file_fails_its_checksum(folder, counted, capsys):
    def edit(data):
        data["verify_seconds"][0] *= 10  # plausible, but not what was measured

    target, drafter, path = stored_file(folder, counted, edit)
    cost_cache.verify_costs(target, drafter, 8, 257)
    assert len(counted) == 2 and "checksum does not match" in capsys.readouterr().err


def test_an_unwritable_folder_is_a_notice_naming_the_fix(folder, counted, capsys, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cost_cache, "write_bytes", full)
    target, drafter = random_pair("llama", seed=5, block_size=8)
    cost_cache.verify_costs(target, drafter, 8, 257)
    err = capsys.readouterr().err
    assert "the disk is full" in err and "DDTREE_CACHE" in err


def test_a_curve_measured_on_a_busy_machine_serves_this_process_only(folder, counted, capsys, monkeypatch):
    """Other processes' load bends a curve for good once it is stored: it is used now, and measured again next time."""
    monkeypatch.setattr(Meter, "busy", 0.8)
    target, drafter = random_pair("llama", seed=5, block_size=8)
    cost = cost_cache.verify_costs(target, drafter, 8, 257)
    assert "0.80 cores" in capsys.readouterr().err and not list(folder.glob("*.json"))
    assert cost_cache.verify_costs(target, drafter, 8, 257) is cost and len(counted) == 1  # this process keeps it
    monkeypatch.setattr(cost_cache, "_measured", {})  # a new process, on a quiet machine
    monkeypatch.setattr(Meter, "busy", 0.1)
    cost_cache.verify_costs(target, drafter, 8, 257)
    assert len(counted) == 2 and len(list(folder.glob("*.json"))) == 1


def test_a_drafter_with_a_smaller_head_gets_a_curve_of_its_own():
    """The draft vocabulary's size is in the key: a pruned head (train prune-vocab) drafts for less, so a curve
    measured with the larger head would overstate its draft cost."""
    from ddtree.train.vocab import pruned_draft_vocab, with_draft_vocab

    target, drafter = random_pair("llama", seed=5, block_size=8)
    reduced = with_draft_vocab(drafter, torch.arange(0, 64), target.model.lm_head.weight)
    pruned = pruned_draft_vocab(reduced, torch.arange(0, 64, 2))
    assert cost_cache.cost_key(target, reduced, 8, 257) != cost_cache.cost_key(target, pruned, 8, 257)
    assert cost_cache.cost_key(target, reduced, 8, 257) == cost_cache.cost_key(
        target, with_draft_vocab(drafter, torch.arange(1, 65), target.model.lm_head.weight), 8, 257)
