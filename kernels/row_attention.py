"""Triton decode attention for the batched data generator: one new query per row, each row over its own keys.

Shapes (R rows, Hq query heads, Hkv KV heads, G = Hq // Hkv, T cache positions, D head dim):
  q        [R, Hq, D]       the step's query of each row (last dim contiguous)
  k, v     [R, Hkv, T, D]   one layer of the batched cache (last dim contiguous)
  lengths  int64 [R]        row r attends to its keys [0, lengths[r]), 1 <= lengths[r] <= T
  out      [R, Hq, D]       in q's dtype

SDPA with a [R, 1, 1, span] mask reads every row's keys up to the longest row's; under continuous refill the
longest row is several times the mean. Here a program (row, KV head) reads its own row's keys only, in BLOCK_N key
blocks up to the row's length (read on the device: one captured graph serves every step). The G query heads of
the KV head form the M axis of one tile (padded to 16 rows for tl.dot); online softmax in fp32, exp2 domain, P
rounded to the K/V dtype for P @ V, as in flash attention (tree_attention's step, shared).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree.base.kernel_files import kernel_module

# the flash-attention step both attention kernels take over a key block (fp32 statistics, P in the K/V dtype), and
# whether Triton runs its interpreter (decided for every kernel at its import)
_tree_attention = kernel_module("tree_attention")
_online_softmax_step, _interpreting = _tree_attention._online_softmax_step, _tree_attention._interpreting

_LOG2E = 1.4426950408889634


@triton.jit
def _row_attention_kernel(
    Q, K, V, Lengths, Out,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_kt, stride_vr, stride_vh, stride_vt, stride_or, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # grid = (R, Hkv)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    n_keys = tl.load(Lengths + row).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_m  # [BLOCK_M]: the query heads of this KV head (rows >= GROUP are padding)
    m_valid = offs_m < GROUP
    q = tl.load(Q + row * stride_qr + heads[:, None] * stride_qh + offs_d[None, :], mask=m_valid[:, None], other=0.0)
    if UPCAST:  # the interpreter only: its tl.dot multiplies bf16's raw bits; widening to fp32 is exact
        q = q.to(tl.float32)
    k_base = K + row * stride_kr + kv_head * stride_kh
    v_base = V + row * stride_vr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a block's new max is never -inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        keys = start + offs_n
        k_valid = keys < n_keys
        k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :], mask=k_valid[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        s = tl.where(k_valid[None, :], s, float("-inf"))
        v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :], mask=k_valid[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, Q.dtype.element_ty, INPUT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(Out + row * stride_or + heads[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=m_valid[:, None])


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                  scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale over each row's first lengths[r] keys) v: q [R, Hq, D], k/v [R, Hkv, T, D], lengths
    int64/int32 [R] on the device (read when the kernel runs; the caller keeps them in 1..T) -> [R, Hq, D]."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"need q [R, Hq, D] and k, v [R, Hkv, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    rows, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != rows or k.shape[3] != d or hkv == 0 or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on rows, head dim or head groups")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim must be a power of two >= 16, got {d}")
    if lengths.shape != (rows,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be int32/int64 [{rows}], got {lengths.dtype} {tuple(lengths.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dim")
    if not (q.device == k.device == v.device == lengths.device) or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError("q, k, v and lengths must share a device, and q, k, v a dtype")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError("row_attention needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    scale = d ** -0.5 if scale is None else scale
    _row_attention_kernel[(rows, hkv)](
        q, k, v, lengths, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), scale * _LOG2E,
        GROUP=group, HEAD_DIM=d, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=64,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 or _interpreting() else "tf32",
        UPCAST=q.dtype != torch.float32 and _interpreting(), num_warps=4, num_stages=2)
    return out


def row_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    """row_attention by SDPA with a [R, 1, 1, T] mask (what the generator runs without the kernel)."""
    rows, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    visible = (torch.arange(t, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    qf = q.reshape(rows, hkv, hq // hkv, d)
    o = torch.nn.functional.scaled_dot_product_attention(qf, k, v, attn_mask=visible, scale=scale)
    return o.reshape(rows, hq, d)
