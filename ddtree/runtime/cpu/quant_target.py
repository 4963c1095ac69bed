"""A target run on its GGUF file's own quantized weights (`ddtree.load(quant="gguf")`).

The target is first loaded in float32 as always (ddtree.models.loading converts the GGUF once, through transformers).
Then each linear layer whose GGUF tensor is Q4_1 or Q8_0 is swapped for a QLinear on the file's blocks, after
checking that the blocks dequantize to exactly the float weights just loaded (bit for bit; the q/k rows that
llama.cpp's converter permutes for Llama are put back in order). So the quantized model IS the float model, with
weights streamed at 5 (Q4_1) or 8.5 (Q8_0) bits instead of 32, and the kernels sum in the float path's order: on
two threads its logits equal the float target's bit for bit. A float target loaded from a GGUF reads the same
blocks for its narrow passes anyway (exact_blocks.py); quant='gguf' takes them at every width and frees
the float weights (less memory, slower wide passes).
Other tensor types (F32, F16, K-quants, ...) stay float. The embedding stays float (a lookup reads one row);
a tied LM head gets its own quantized copy, as llama.cpp uses it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ...base.config import ConfigError
from ...models.gguf_tensors import GGUFTensor, read_tensors
from ...models.protocol import reference
from .qlinear import KINDS, QLinear, QWeight, last_level_cache_bytes

# weights this many times the last-level cache stream past it (streams_past_cache)
STREAM_CACHE_MULTIPLE = 2
# our module path within a layer -> the GGUF tensor name (blk.{i}.NAME.weight)
LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation for Llama (rows [heads, D/2, 2] -> [heads, 2, D/2])."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _matching(tensor, weight: torch.Tensor, heads: int | None, name: str) -> QWeight | None:
    """The GGUF tensor as a QWeight equal to `weight` when dequantized; None for a type that stays float."""
    kind = tensor.kind
    if kind not in KINDS:
        return None
    q = QWeight.from_blocks(kind, tensor.data, tuple(weight.shape))
    if torch.equal(q.dequantize(), weight):
        return q
    if heads is not None:
        permuted = q.permute_rows(llama_row_order(weight.shape[0], heads))
        if torch.equal(permuted.dequantize(), weight):
            return permuted
    raise ConfigError(f"GGUF tensor {name} ({kind}) does not dequantize to the float weights loaded from the same "
                      "file; is the GGUF the one this target was converted from? Load without quant='gguf'")


def quantize_target(model, gguf_path: Path, int8: bool = False) -> str | None:
    """Swap the reference target `model`'s fused linear layers (ddtree.models.fused) for QLinears on `gguf_path`'s blocks,
    in place; returns what it runs on (e.g. "gguf Q4_1/Q8_0"), None where no tensor had a supported type. The
    CPU runtime builds its stack over them afterwards (runtime.cpu_target). int8: the products quantize their
    activations to int8 per block of 32, as llama.cpp does ("gguf-int8": another arithmetic, no longer the float
    model's function; QWeight.int8)."""
    if model.backend != "own" or not model.fused:
        raise ConfigError("quant='gguf' needs the own-code target backend (backend='own')")
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise ConfigError(f"quant='gguf' runs on the CPU in float32 (asked: {model.device.type} "
                          f"{str(model.dtype).removeprefix('torch.')}); pass device='cpu' and no dtype")
    layers, head = gguf_blocks(model, gguf_path)
    if int8:
        stream = streams_past_cache([q for quant in layers for q in quant.values()] + [head])
        layers = [{path: None if q is None else replace(q, int8=True, stream=stream) for path, q in quant.items()}
                  for quant in layers]
        head = None if head is None else replace(head, int8=True, stream=stream)
    kinds = set()
    for layer, quant in zip(model.model.layers, layers):
        _swap_layer(layer, quant)
        kinds.update(q.kind for q in quant.values() if q is not None)
    if head is not None:
        model.lm_head = QLinear(head)
        kinds.add(head.kind)
    return "gguf " + "/".join(sorted(kinds)) + (" int8" if int8 else "") if kinds else None


def streams_past_cache(weights: list[QWeight | None], cache_bytes: int | None = None) -> bool:
    """Should a pass prefetch these weights non-temporally (QWeight.stream)? Where they are at least
    STREAM_CACHE_MULTIPLE times the last-level cache (cache_bytes; None: this CPU's), no pass finds them cached
    anyway, and streaming them leaves the cache to what can stay: the drafter's weights, read right after a target
    pass, and the KV caches."""
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    total = sum(q.qs.nbytes + (0 if q.d is None else q.d.nbytes) for q in weights if q is not None)
    return cache_bytes is not None and total >= STREAM_CACHE_MULTIPLE * cache_bytes


def int8_activations(quant: str | None) -> bool:
    """Does a target whose `quant` label (Target.quant, from quantize_target) is this quantize its activations to
    int8? Then it computes another function than the float model (a peer's tokens are compared, not checked)."""
    return bool(quant) and quant.endswith(" int8")


def _tensors(gguf_path: Path) -> dict[str, GGUFTensor]:
    """The file's tensors by name: read_tensors (the table alone), or gguf-py's reader for a file it does not take
    (big-endian, version 1)."""
    try:
        return read_tensors(gguf_path)
    except ValueError:
        from gguf import GGUFReader

        return {t.name: GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), t.data)
                for t in GGUFReader(str(gguf_path)).tensors}


def gguf_blocks(target, gguf_path: Path) -> tuple[list[dict[str, QWeight | None]], QWeight | None]:
    """The GGUF's blocks of each layer's projections (by module path, LAYER_TENSORS) and of the LM head, each
    checked to dequantize exactly to the float weight `target` holds (None for a tensor type that stays float).
    A ConfigError where the file is unreadable, lacks a tensor, or is not these float weights."""
    try:
        tensors = _tensors(gguf_path)
    except Exception as e:  # noqa: BLE001 - gguf raises many types for a bad file
        raise ConfigError(f"cannot read GGUF {gguf_path} ({type(e).__name__}: {e})") from e
    cfg, layers = target.cfg, []
    for i, layer in enumerate(reference(target).model.layers):
        quant = {}
        for path, gguf_name in LAYER_TENSORS.items():
            name = f"blk.{i}.{gguf_name}.weight"
            if name not in tensors:
                raise ConfigError(f"GGUF {gguf_path.name} has no tensor {name}")
            heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(gguf_name)
            quant[path] = _matching(tensors[name], layer.get_submodule(path).weight.detach(), heads, name)
        layers.append(quant)
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return layers, _matching(tensors[head_name], reference(target).lm_head.weight.detach(), None, head_name)


def fused_groups(quant: dict[str, QWeight | None]) -> tuple[QWeight | None, ...]:
    """One layer's blocks (gguf_blocks) as the fused layout's (qkv, o, gate_up, down): q/k/v and gate/up rows
    concatenated where all of a group has blocks of one kind, else None for that group."""
    def group(*paths):
        parts = [quant[p] for p in paths]
        if any(p is None for p in parts) or len({p.kind for p in parts}) > 1:
            return None
        return parts[0] if len(parts) == 1 else QWeight.cat(parts)

    return (group("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), group("self_attn.o_proj"),
            group("mlp.gate_proj", "mlp.up_proj"), group("mlp.down_proj"))


def _swap_layer(layer, quant: dict[str, QWeight | None]) -> None:
    """One fused layer onto its QWeights: q/k/v and gate/up fused again where fused_groups() can (the rest stays
    float); the separate projections become row views of the fused QWeight."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = fused_groups(quant)
    groups = ((attn, qkv, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "self_attn."),
              (mlp, gate_up, "gate_up_proj", ("gate_proj", "up_proj"), "mlp."))
    for module, fused, fused_name, names, prefix in groups:
        if fused is None:
            continue  # stays float
        setattr(module, fused_name, QLinear(fused, getattr(module, fused_name).bias))
        start = 0
        for n in names:
            rows = quant[prefix + n].shape[0]
            setattr(module, n, QLinear(fused.rows(start, start + rows), getattr(module, n).bias))
            start += rows
    for module, name, weight in ((attn, "o_proj", o), (mlp, "down_proj", down)):
        if weight is not None:
            setattr(module, name, QLinear(weight, getattr(module, name).bias))


def dequantized_state(target) -> dict[str, torch.Tensor]:
    """The float state dict of a quantized target: its QLinears' weights dequantized (exactly the float model's).
    For the `hf` peer, which runs transformers on the same weights."""
    model = reference(target)
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if isinstance(module, QLinear) and not name.endswith(("qkv_proj", "gate_up_proj")):  # fused: not HF's
            state[f"{name}.weight"] = module.weight.dequantize()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
    return state
