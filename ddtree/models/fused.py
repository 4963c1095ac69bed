"""The inference layout of a loaded model's weights: fewer, larger matmuls per layer.

A decoder layer makes 7 matmuls (q, k, v, o, gate, up, down) plus two RoPE applications. Fusing q/k/v into one
[(Hq + 2 Hkv) * D, H] weight and gate/up into one [2 I, H] weight makes it 4 matmuls and one RoPE. The fused
weights are built once at load, and the original q/k/v/gate/up parameters become row-slice VIEWS of them, so
nothing is stored twice and the state dict (names, shapes, values) is unchanged: the fused linears hold plain
tensors, not parameters.

Fusing is for inference only (training keeps separate parameters) and is done after the model has its final
device and dtype: a later `.to()` would copy the views apart from the fused weights (TargetModel._apply unfuses
and fuses again around it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..base.config import ConfigError
from .layers import DecoderLayer


class FusedLinear(nn.Module):
    """F.linear over a fused weight [sum out, in] (and bias [sum out]) kept as plain tensors: the parameters are
    the separate projections' row views of them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _fuse(linears: list[nn.Linear]) -> FusedLinear:
    """Concatenate the linears' weights along the output axis and rebind each one's weight (and bias) as a view
    of its rows."""
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
    return FusedLinear(weight, bias)


def fuse_layer(layer: DecoderLayer) -> None:
    """One layer's q/k/v and gate/up projections fused (idempotent)."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_proj is None:
        attn.qkv_proj = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    if mlp.gate_up_proj is None:
        mlp.gate_up_proj = _fuse([mlp.gate_proj, mlp.up_proj])


def unfuse_layer(layer: DecoderLayer) -> None:
    """Back to the separate projections (the training layout): each gets its own storage again."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    if not all(isinstance(lin.weight, torch.Tensor) for lin in linears):
        raise ConfigError("this model's layers run on quantized blocks (quant='gguf'), which have no float layout "
                          "to go back to; load it without quant to move, convert or train it")
    for lin in linears:
        lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
        if lin.bias is not None:
            lin.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
    attn.qkv_proj = mlp.gate_up_proj = None
