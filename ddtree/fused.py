"""Inference layouts of a loaded model's weights: fewer, larger matmuls per layer and a CPU-friendly LM head.

A small model's 1-token target pass on a CPU is mostly matmuls; per layer it made 7 of them (q, k, v, o, gate, up, down) plus two separate RoPE applications. Fusing q/k/v into
one [(Hq + 2 Hkv) * D, H] weight and gate/up into one [2 I, H] weight makes it 4 matmuls and one RoPE. The
fused weights are built once at load, and the original q/k/v/gate/up parameters become row-slice VIEWS of them,
so nothing is stored twice and the state dict (names, shapes, values) is unchanged.

One-row passes (plain decoding): for a weight with more outputs than inputs, `F.linear(x, W)` streams W at
a fraction of the memory bandwidth that `x @ W.T` reaches with W.T stored contiguous (docs/cpu-speed.md); o
and down, with fewer outputs than inputs, are as fast with F.linear. So a float32 CPU target keeps contiguous
[in, out] copies of the fused qkv, gate/up and the LM head for one-row passes; wider passes (verify, prefill)
keep F.linear, which is as fast or faster there.
Where the C++ layer stack packs the layers' weights (ddtree.cpu_stack.packs), its kernel runs their one-row
passes as fast or faster, and TargetModel.fuse drops the layers' copies again (only the LM head's stays).

Fusing is for inference only (training keeps separate parameters) and is done after the model has its final
device and dtype: a later `.to()` would copy the views apart from the fused weights.
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import DecoderLayer

# The 1-row copies cost memory: qkv, gate/up and the LM head stored twice (most of a small model's weights again).
# Worth it on small CPU targets, where plain decoding is bound by how fast these weights stream.
TRANSPOSED_MAX_PARAMS = 2_000_000_000


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights along the output axis and rebind each one's weight (and bias) as a view
    of its rows. Returns the fused weight [sum out, in] and bias [sum out] (None when they have none)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        raise ValueError("cannot fuse projections of which only some have a bias")
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    sizes = [lin.out_features for lin in linears]
    for lin, w in zip(linears, weight.split(sizes)):
        lin.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        for lin, b in zip(linears, bias.split(sizes)):
            lin.bias = nn.Parameter(b, requires_grad=False)
    return weight, bias


def fuse_layer(layer: DecoderLayer, transposed: bool = False) -> None:
    """One layer's q/k/v and gate/up projections fused (idempotent); transposed: also keep contiguous [in, out]
    copies of both for 1-row passes (layers.project)."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_weight is None:
        attn.qkv_weight, attn.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    if mlp.gate_up_weight is None:
        mlp.gate_up_weight, _ = _fuse([mlp.gate_proj, mlp.up_proj])
    if transposed:
        attn.qkv_t = attn.qkv_weight.t().contiguous()
        mlp.gate_up_t = mlp.gate_up_weight.t().contiguous()


def unfuse_layer(layer: DecoderLayer) -> None:
    """Back to the separate projections (the eager reference layout): each gets its own storage again."""
    attn, mlp = layer.self_attn, layer.mlp
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
        if lin.bias is not None:
            lin.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
    attn.qkv_weight = attn.qkv_bias = attn.qkv_t = mlp.gate_up_weight = mlp.gate_up_t = None


def wants_transposed(weight: torch.Tensor, num_params: int) -> bool:
    """Keep the 1-row transposed copies? On float32 CPU models up to TRANSPOSED_MAX_PARAMS parameters."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and num_params <= TRANSPOSED_MAX_PARAMS


def fuse_model(model: nn.Module, layers, lm_head: nn.Linear, layer_copies: bool = True) -> torch.Tensor | None:
    """Fuse every layer in `layers` of `model`; returns the LM head's contiguous transpose [H, V] when the
    1-row copies are kept (wants_transposed), else None. layer_copies=False: the layers get no 1-row copies
    (the C++ stack's packed weights serve their 1-row passes), only the LM head may."""
    w = lm_head.weight
    transposed = wants_transposed(w, sum(p.numel() for p in model.parameters()))
    for layer in layers:
        fuse_layer(layer, transposed and layer_copies)
    return w.detach().t().contiguous() if transposed else None
