"""The adaptive budget's verify-cost curve, measured once per machine and kept on disk.

Measuring it (`budget.calibrate`) costs a few seconds on a GPU and up to tens of seconds on a 2-core CPU, so
it is done once per (machine, target shape, drafter shape, block and weight storage, dtype, device, threads,
attention backend, torch version): everything the timings depend on, and nothing they do not (the weights' values).
That key is stored in the file beside the curve:

    $DDTREE_CACHE/verify-costs/<sha1 of the key>.json
        {"key": {...}, "sizes": [1, 2, ...], "verify_seconds": [...], "fixed_seconds": 0.0083,
         "draft_seconds": [...], "context": 256, "key_seconds": [...]}

The file also carries the SHA-256 of its content (ddtree/base/cache.py). A file that does not parse, fails its checksum,
holds times that are not positive and finite (the adaptive budget divides by them), or whose key differs is
measured again and replaced, with a notice where it was damaged. Delete the folder to force a new measurement
(after a BIOS or power-setting change, say).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from pathlib import Path

import torch

from .budget import CALIBRATION_SIZES, CostModel, calibrate
from ..base.cache import cache_root, digest_json, notice, sweep, write_bytes, write_error
from ..base.machine_load import LoadMeter

# a curve measured while other processes used more cores than this is not stored (the benchmark flags such runs too)
BUSY_CORES = 0.25
FORMAT = 12  # bump when calibrate() measures differently or the passes change: older files then miss
# 2: the C++ decoder layers (ddtree/runtime/cpu/stack.py) made CPU passes faster, and not by one factor
# 3: the float32 row kernel prefetches over all its sweeps, the stack's attention and packed weights: CPU verify
#    passes of 2-9 rows got cheaper against a 1-row step
# 5: the draft pass timed at every length (budget="auto" drafts only as deep as its trees go)
# 6: RoPE rows from a table, the final norms and the greedy argmax in C++: CPU drafts and steps got cheaper
# 9: the file carries its checksum (sha256)
# 10: each size's hopeless-test pass runs once untimed first (a first call set up graphs or kernels: the curve
#     stopped at 1-2 nodes on a GPU)
# 11: drafts timed after a target pass with a step's context to flush (as decoding meets them: 2x the warm
#     time on a CPU), the host work timed, not a tenth of the draft
# 12: the calibration's context and the seconds each further committed token adds per size (key_seconds)
_measured: dict[str, CostModel] = {}  # this process's curves, by digest


def machine_name(device) -> str:
    """The GPU's name on CUDA, else the CPU model and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def cost_key(target, drafter, block_size: int, max_nodes: int) -> dict:
    t, d = target.cfg, drafter.cfg.model
    return dict(format=FORMAT, machine=machine_name(target.device), device=target.device.type,
                dtype=str(target.dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                attention=target.attention_backend, torch=torch.__version__,
                target=[t.arch, t.vocab_size, t.hidden_size, t.intermediate_size, t.num_layers, t.num_heads,
                        t.num_kv_heads, t.head_dim],
                drafter=[d.num_layers, d.hidden_size, d.intermediate_size, d.num_heads, d.num_kv_heads,
                         len(drafter.cfg.target_layer_ids), drafter.cfg.draft_vocab],  # the head's rows: its cost
                drafter_storage=drafter.describe()["storage"],  # q8 / bf16 / float32: what its pass streams
                block_size=block_size, max_nodes=max_nodes,
                **target.describe())  # its fast paths: quantization, C++ layers and kernel build, exact blocks


def costs_dir() -> Path:
    return cache_root() / "verify-costs"


def cost_path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return costs_dir() / f"{digest}.json"


def verify_costs(target, drafter, block_size: int, max_nodes: int) -> CostModel:
    """The cost curve for trees of up to `max_nodes` nodes: from this process, from disk, or measured now."""
    key = cost_key(target, drafter, block_size, max_nodes)
    path = cost_path(key)
    if path.name in _measured:
        return _measured[path.name]
    cost = read_costs(path, key)
    if cost is None:
        sizes = tuple(n for n in CALIBRATION_SIZES if n < max_nodes) + (max_nodes,)
        meter = LoadMeter()
        cost = calibrate(target, drafter, sizes=sizes, block_size=block_size)
        busy = meter.lap()
        if busy is not None and busy > BUSY_CORES:  # the curve is this moment's, not the machine's
            notice(f"other processes used {busy:.2f} cores while the verify-cost curve was measured: it serves this "
                   "process only, and is measured again next time")
        else:
            write_costs(path, key, cost)
    _measured[path.name] = cost
    return cost


def read_costs(path: Path, key: dict) -> CostModel | None:
    """The stored curve, or None when the file is missing, for another key, or damaged (then with a notice)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return _damaged(path, f"unreadable: {e}")
    if not isinstance(data, dict) or data.get("key") != key:
        return None  # another configuration's file under a colliding name, or an older format's
    digest = data.pop("sha256", None)
    if digest != digest_json(data):
        return _damaged(path, "its checksum does not match its content")
    try:
        cost = CostModel(tuple(int(n) for n in data["sizes"]), tuple(float(x) for x in data["verify_seconds"]),
                         float(data["fixed_seconds"]), tuple(float(x) for x in data["draft_seconds"]),
                         int(data["context"]), tuple(float(x) for x in data["key_seconds"]))
    except (KeyError, TypeError, ValueError) as e:
        return _damaged(path, f"not a cost curve: {e}")
    times = cost.verify_seconds + cost.draft_seconds
    if not all(math.isfinite(t) and t > 0 for t in times) or not (math.isfinite(cost.fixed_seconds)
                                                                  and cost.fixed_seconds >= 0):
        return _damaged(path, "a time that is not positive and finite")
    if cost.context < 0 or not all(math.isfinite(t) and t >= 0 for t in cost.key_seconds):
        return _damaged(path, "a context or per-token time that is negative or not finite")
    return cost


def _damaged(path: Path, problem: str) -> None:
    notice(f"the verify-cost file {path} is damaged ({problem}); measuring again")
    return None


def write_costs(path: Path, key: dict, cost: CostModel) -> None:
    data = dict(key=key, sizes=list(cost.sizes), verify_seconds=list(cost.verify_seconds),
                fixed_seconds=cost.fixed_seconds, draft_seconds=list(cost.draft_seconds), context=cost.context,
                key_seconds=list(cost.key_seconds))
    data["sha256"] = digest_json(data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep(path.parent)
        write_bytes(path, (json.dumps(data, indent=1) + "\n").encode())  # atomic: concurrent ranks read whole files
    except OSError as e:
        notice(f"{write_error(e, path.parent, 'the verify-cost curve')} (it is measured again next time)")
