"""A float target's weights read from its GGUF file's own blocks, where they are exactly those blocks' values.

Why: the embedded default's float32 weights ARE its GGUF's Q4_1 (layers) and Q8_0 (LM head) blocks dequantized
(ddtree.models.loading converts that file). The CPU kernels (kernels/qlinear.cpp) sum each output in one order whatever
format the weight is stored in, and a block dequantizes in registers to exactly the float value, so a product
over the blocks has the bits of the product over the float weights: the same model, with 5 (Q4_1) or 8.5 (Q8_0)
bits read per weight instead of 32. A plain decoding step streams every weight once, so its matmuls cost a
fraction of the float ones (docs/cpu-speed.md). Wider passes are compute-bound
and keep the float weights (qlinear.layer_max_rows(), head_max_rows()).

Unlike quant='gguf' (quant_target.py), the float model stays whole: training, .to(), the eager reference
and prefills use the float weights, and a weight written in place drops the blocks (runtime.CPUTarget).
Reading the GGUF's metadata takes seconds, so the blocks are checked against the float weights once and cached:
$DDTREE_CACHE/exact-blocks/<the conversion's folder name>/blocks.safetensors, keyed by the conversion's checksum
and sealed by ddtree/base/cache.py: a file whose bytes changed since is checked against the GGUF again (a damaged
block would decode a different model, and every method would agree with it).
load(gguf_blocks=False) (or DDTREE_GGUF_BLOCKS=0) turns them off: the benchmark's float-storage comparison.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...base.cache import CACHE_MANIFEST, cache_root, notice, read_manifest, replacing_dir, seal, verify
from ...base.config import ConfigError
from .qlinear import QWeight
from .quant_target import fused_groups, gguf_blocks

FORMAT = 2  # 2: Q4_1 in 40-byte spans with fp16 scales (1: lanes, d and m apart)
SLOTS = ("qkv", "o", "gate_up", "down")

@dataclass
class ExactBlocks:
    """Per layer the fused layout's (qkv, o, gate_up, down) blocks, and the LM head's; None where a weight has
    none (a tensor type that stays float in the file)."""
    layers: list[tuple[QWeight | None, ...]]
    head: QWeight | None

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """For safetensors: the blocks' tensors and, by entry name, their kinds."""
        tensors, kinds = {}, {}
        entries = [(f"layers.{i}.{slot}", q) for i, qs in enumerate(self.layers) for slot, q in zip(SLOTS, qs)]
        for name, q in entries + [("head", self.head)]:
            if q is not None:
                kinds[name] = q.kind
                tensors[f"{name}.qs"] = q.qs.contiguous()
                if q.d is not None:
                    tensors[f"{name}.d"] = q.d.contiguous()
        return tensors, kinds

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], kinds: dict[str, str], num_layers: int) -> "ExactBlocks":
        def get(name):
            if name not in kinds:
                return None
            return QWeight(kinds[name], tensors[f"{name}.qs"], tensors.get(f"{name}.d"))

        return cls([tuple(get(f"layers.{i}.{slot}") for slot in SLOTS) for i in range(num_layers)], get("head"))


def find(model, gguf_path: Path, conversion: Path) -> ExactBlocks | None:
    """The exact GGUF blocks of a float32 reference target `model` (loaded from the conversion `conversion` of
    `gguf_path`), from the cache or checked and cached now; None where the GGUF's blocks are not these weights."""
    key = cache_key(conversion)
    blocks = _cached(key, len(model.model.layers)) if key is not None else None
    if blocks is None:
        blocks = _extract(model, gguf_path)
        if key is not None:
            _store(key, blocks)  # a file that does not match is remembered too, so it is read only once
    if blocks.head is None and all(q is None for qs in blocks.layers for q in qs):
        return None
    return blocks


def cache_key(conversion: Path) -> dict | None:
    """What the cached blocks must have been checked against: the conversion (by folder name: the GGUF's path,
    size and mtime) and its weights' checksum. None where the conversion has no manifest."""
    try:
        digest = json.loads((conversion / CACHE_MANIFEST).read_text())["files"]["model.safetensors"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"format": FORMAT, "conversion": conversion.name, "weights_sha256": digest}


def cache_file(key: dict) -> Path:
    return cache_root() / "exact-blocks" / key["conversion"] / "blocks.safetensors"


def _cached(key: dict, num_layers: int) -> ExactBlocks | None:
    """The cached blocks for `key`, or None (with a notice where a file is there but damaged or for another key)."""
    from safetensors import safe_open

    path = cache_file(key)
    if not path.parent.exists():
        return None
    problems = verify(path.parent, required=(path.name,))
    if not problems and (read_manifest(path.parent) or {}).get("key") != key:
        problems = ["made for another conversion or format"]
    if not problems:
        try:
            with safe_open(str(path), framework="pt") as f:
                kinds = json.loads((f.metadata() or {})["kinds"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            return ExactBlocks.from_tensors(tensors, kinds, num_layers)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a file it cannot read
            problems = [f"unreadable ({type(e).__name__}: {e})"]
    notice(f"the cached exact blocks {path.parent} are damaged or foreign ({'; '.join(problems)}); "
           "checking the GGUF's blocks again")
    return None


def _store(key: dict, blocks: ExactBlocks) -> None:
    from safetensors.torch import save_file

    tensors, kinds = blocks.tensors()
    try:
        with replacing_dir(cache_file(key).parent, "the exact GGUF blocks") as tmp:
            save_file(tensors, str(tmp / "blocks.safetensors"), metadata={"key": json.dumps(key),
                                                                          "kinds": json.dumps(kinds)})
            seal(tmp, key=key)
    except ConfigError as e:  # a read-only or full cache costs the next load the check again, nothing else
        notice(f"{e} (the blocks are used now and checked again on the next load)")


def _extract(target, gguf_path: Path) -> ExactBlocks:
    try:
        layers, head = gguf_blocks(target, gguf_path)
    except ConfigError:  # another file's weights, or a tensor missing: no blocks, the float weights alone
        return ExactBlocks([(None,) * len(SLOTS) for _ in target.model.layers], None)
    return ExactBlocks([fused_groups(quant) for quant in layers], head)
