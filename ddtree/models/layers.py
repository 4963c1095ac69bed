"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, attention projections, SwiGLU.

Batch size is 1 everywhere in decoding, so activations are [N, H] (N tokens) and per-head tensors are
[heads, N, head_dim]. Parameter names mirror Hugging Face's Llama/Qwen3 so state dicts load unchanged.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..base.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as HF Llama/Qwen3: normalize in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """RoPE cos/sin for the positions of one forward pass. On a CPU they are rows of a table computed once for
    positions 0..n-1 (n doubled when a pass goes past it) by the same ops: one index op per pass instead of ~8,
    whose dispatch costs more than their arithmetic (three passes a speculative step)."""
    TABLE_MIN = 1024

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table: tuple | None = None  # (the inv_freq it is of, (its version, dtype), cos [n, D], sin [n, D])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N] -> cos, sin [N, head_dim] in the model dtype (HF computes in fp32 and casts too).
        if positions.device.type != "cpu" or self.inv_freq.device.type != "cpu" or positions.dim() != 1:
            return self._compute(positions, dtype)
        cos, sin = self.table(int(positions.max()) + 1 if positions.numel() else 1, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def table(self, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU table: cos, sin [>= rows, head_dim] for positions 0, 1, ... (forward() reads its rows)."""
        table, inv_freq = self._table, self.inv_freq
        state = (0 if inv_freq.is_inference() else inv_freq._version, dtype)  # inference tensors have no version
        if table is None or table[0] is not inv_freq or table[1] != state or rows > table[2].shape[0]:
            size = max(self.TABLE_MIN, 2 * rows, 0 if table is None else table[2].shape[0])
            with torch.inference_mode(False), torch.no_grad():  # made inside a decoding pass, read by training too
                table = self._table = (inv_freq, state, *self._compute(torch.arange(size), dtype))
        return table[2], table[3]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    if cfg.rope_scaling is None:
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
        return 1.0 / (cfg.rope_theta ** exponents), 1.0
    # Non-default RoPE (llama3, yarn, linear, ...): use transformers' own parameter functions.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"RoPE type {rope_type!r} is not supported (sequence-length dependent or unknown)")
    hf_cfg = AutoConfig.for_model(cfg.arch, **{**_without_type(cfg.to_hf()), "rope_scaling": {**cfg.rope_scaling,
                                                                           "rope_theta": cfg.rope_theta}})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [heads, N, D]; cos/sin [N, D]; rotate-half layout (HF convention).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Projections of one attention layer. The attention itself happens in ddtree.models.attention (the seam)."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Set by ddtree.models.fused.fuse_layer for inference: one linear [H -> (Hq + 2 Hkv) * D] whose weight's row
        # slices ARE q/k/v_proj's weights (views, so the state dict is unchanged). None: three projections.
        self.qkv_proj: nn.Module | None = None

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(0, 1), cos, sin)  # [Hq, N, D]

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(0, 1), cos, sin), v.transpose(0, 1)  # [Hkv, N, D] each

    def fused_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """query() and key_value() from one matmul (weights fused by ddtree.models.fused), RoPE applied to the query and
        key heads together. x [N, H] -> q [Hq, N, D], k, v [Hkv, N, D]."""
        n, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, hq + 2 * hkv, d)
        q, k, v = qkv.split((hq, hkv, hkv), dim=1)
        if self.q_norm is not None:  # per-head norms differ for q and k, so they stay apart (Qwen3)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        else:
            qk = qkv[:, :hq + hkv]
        qk = apply_rope(qk.transpose(0, 1), cos, sin)  # [Hq + Hkv, N, D]
        return qk[:hq], qk[hq:], v.transpose(0, 1)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        # attn [Hq, N, D] -> [N, hidden]
        return self.o_proj(attn.transpose(0, 1).reshape(attn.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # H -> 2 I over views of gate/up_proj (ddtree.models.fused), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [N, I] each
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The one residual block of the target, the drafter (decoding and training) and the batched generator.
    Where the keys and values go and what the queries see differs between them, so that part is a callback:
    attend(q [Hq, N, D], k [Hkv, N, D], v [Hkv, N, D]) -> [Hq, N, D], given this pass's new rows only."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [N, H] -> [N, H]; cos, sin [N, D] at the rows' positions."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        if attn.qkv_proj is not None:
            h = h + attn.output(attend(*attn.fused_qkv(x, cos, sin)))
        else:
            h = h + attn.output(attend(attn.query(x, cos, sin), *attn.key_value(x, cos, sin)))
        return h + self.mlp(self.post_attention_layernorm(h))


def _without_type(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "model_type"}
