"""Triton tree attention for the DDTree verify pass (flash-attention style, bit-masked tree part).

Shapes (Hq query heads, Hkv KV heads, G = Hq // Hkv, N tree nodes, D head dim, T cache rows >= past + N):
  q    [Hq, N, D]   one query per tree node (node 0 is the root; parents precede children)
  k, v [Hkv, T, D]  views of the KV cache: rows [0, past) are the committed past, row past + j is node j
  bits int32 [N, W], W = ceil(N / 32): bit j % 32 of word j // 32 in row i  <=>  node i sees node j
  out  [Hq, N, D]   in q's dtype

The G query heads of one KV head are folded into the M axis of a tile, node-major: folded row
r = node * G + g reads query head kv_head * G + g, so a tile of BLOCK_M rows covers BLOCK_M // G nodes and
K/V are read once per KV-head group. Each program streams the past in BLOCK_N key blocks (only the
`< past` bound is masked), then the tree's key blocks with the packed ancestor bits (no dense float mask is
ever built). Online softmax runs in fp32 in the exp2 domain. Split-K ("flash decoding"): with
num_splits > 1 the past blocks are shared out among splits, the last split also takes the tree part, each
split writes a normalised fp32 partial output plus its log2-sum-exp, and `_combine_kernel` merges them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, P_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One key block. s: fp32 [BLOCK_M, BLOCK_N] log2-domain scores (-inf = masked); v [BLOCK_N, BLOCK_D].
    P is rounded to P_DTYPE (the K/V dtype) for the tensor-core P @ V, as in flash attention."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite, so m_new is never -inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(P_DTYPE).to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tree_attention_kernel(
    Q, K, V, Bits, Out, PartO, PartLse, PastLen,
    stride_qh, stride_qn, stride_qd,
    stride_kh, stride_kt, stride_kd,
    stride_vh, stride_vt, stride_vd,
    stride_bn, stride_bw,
    stride_oh, stride_on, stride_od,
    past_len, n_nodes, blocks_per_split, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, CAUSAL_TREE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PAST_ON_DEVICE: tl.constexpr,
):
    # grid = (cdiv(G * N, BLOCK_M), Hkv, num_splits)
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    if PAST_ON_DEVICE:  # read at run time (a captured CUDA graph serves every past length): the splits share it out
        past_len = tl.load(PastLen)
        blocks_per_split = tl.cdiv(tl.cdiv(past_len, BLOCK_N), n_splits)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # folded rows [BLOCK_M]
    node = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = node < n_nodes
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + head[:, None] * stride_qh + node[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:  # interpreter only: its tl.dot multiplies bf16's raw uint16 bits and runs fp16 through numpy's
        q = q.to(tl.float32)  # slow non-BLAS path; widening 16-bit operands to fp32 is exact (as on tensor cores)

    k_head = K + kv_head * stride_kh
    v_head = V + kv_head * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) the committed past: visible to every query, only the `< past_end` bound is masked.
    past_start = split * blocks_per_split * BLOCK_N
    past_end = tl.minimum(past_len, past_start + blocks_per_split * BLOCK_N)
    for start in range(past_start, past_end, BLOCK_N):
        cols = start + offs_n  # [BLOCK_N] cache rows
        col_ok = cols < past_end
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + cols[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        v = tl.load(v_head + cols[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, Q.dtype.element_ty, INPUT_PRECISION)

    # 2) the tree rows past + j, masked by the packed ancestor bits (last split only).
    n_words = (n_nodes + 31) // 32
    tree_end = n_nodes
    if CAUSAL_TREE:  # lower-triangular bits: nodes beyond this tile's last node are never visible
        tree_end = tl.minimum(n_nodes, ((pid_m + 1) * BLOCK_M - 1) // GROUP + 1)
    tree_end = tl.where(split == n_splits - 1, tree_end, 0)
    for start in range(0, tree_end, BLOCK_N):
        j = start + offs_n  # [BLOCK_N] node index of each key
        col_ok = j < n_nodes
        kv_mask = col_ok[:, None] & d_ok[None, :]
        cols = past_len + j
        k = tl.load(k_head + cols[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        # BLOCK_N // 32 ancestor words per query row, expanded to one bit per key (words past N load as 0).
        w_idx = start // 32 + tl.arange(0, BLOCK_N // 32)  # [BLOCK_N // 32]
        words = tl.load(Bits + node[:, None] * stride_bn + w_idx[None, :] * stride_bw,
                        mask=row_ok[:, None] & (w_idx < n_words)[None, :], other=0)  # [BLOCK_M, BLOCK_N // 32]
        bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1  # [BLOCK_M, BLOCK_N // 32, 32]
        visible = (tl.reshape(bits, [BLOCK_M, BLOCK_N]) != 0) & col_ok[None, :]  # ignore padding bits >= N
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_head + cols[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, Q.dtype.element_ty, INPUT_PRECISION)

    # l == 0 on padding rows (never stored) and, with the past read on the device, on a split that got no past
    # block: its partial is 0 with log2-sum-exp -1e30, which the combine weighs 0
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:  # fp32 partials: PartO [S, Hq, N, BLOCK_D], PartLse [S, Hq, N] (log2 domain)
        part_row = (split * tl.num_programs(1) * GROUP + head) * n_nodes + node  # [BLOCK_M]
        tl.store(PartO + part_row[:, None] * BLOCK_D + offs_d[None, :], out, mask=out_mask)
        tl.store(PartLse + part_row, m_i + tl.log2(l_safe), mask=row_ok)
    else:
        o_ptrs = Out + head[:, None] * stride_oh + node[:, None] * stride_on + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_kernel(PartO, PartLse, Out, n_splits, n_nodes, rows_per_split,
                    stride_oh, stride_on, stride_od,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # grid = (Hq * N,): one (head, node) row; merges its n_splits partials by their log2-sum-exp.
    row = tl.program_id(0)
    head = row // n_nodes
    node = row % n_nodes
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    lse = tl.load(PartLse + offs_s * rows_per_split + row, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    o = tl.load(PartO + (offs_s[:, None] * rows_per_split + row) * BLOCK_D + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(o * w[:, None], 0)
    tl.store(Out + head * stride_oh + node * stride_on + offs_d * stride_od, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class TreeAttentionConfig:
    block_m: int = 64  # folded query rows (G * nodes) per tile; >= 16 for tl.dot
    block_n: int = 64  # keys per block, a multiple of 32 (one ancestor word per 32 keys)
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 1  # split-K over the past (> 1: partials + combine kernel)


def _interpreting() -> bool:
    """True when Triton decorated the kernels for its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return type(_tree_attention_kernel).__name__ == "InterpretedFunction"


def select_config(n_rows: int, past_len: int, head_dim: int, n_kv_heads: int,
                  device: torch.device | str = "cuda", elem_bytes: int = 2) -> TreeAttentionConfig:
    """Heuristic tile sizes. n_rows = G * N folded query rows per KV head; elem_bytes: 2 (bf16/fp16) or 4
    (fp32, whose K/V tiles take twice the shared memory)."""
    block_m = min(128, max(16, triton.next_power_of_2(n_rows)))
    if torch.device(device).type != "cuda":  # interpreter: few large numpy ops are the fastest
        return TreeAttentionConfig(block_m=block_m, block_n=128, num_warps=4, num_stages=1)
    # H100 (checked with ptxas for sm_90a: no spills, smem <= 140 KB with 3 stages).
    if head_dim <= 64:
        block_n = 128
    elif head_dim <= 128:
        block_n = 128 if block_m <= 32 else 64
    else:
        block_m, block_n = min(block_m, 64), 32
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 3 if head_dim <= 128 else 2
    if elem_bytes >= 4:  # fp32 tiles take twice the shared memory and registers (3 stages of 128 x 128 K/V:
        # ~400 KB, over the H100's 227 KB); checked with ptxas by compile_check.py (small spills remain: untuned)
        block_m = min(block_m, 64 if head_dim <= 128 else 16)
        block_n = 64 if head_dim <= 64 or (block_m <= 16 and head_dim <= 128) else 32
        num_warps, num_stages = (8 if block_m >= 64 else 4), 2
    programs = triton.cdiv(n_rows, block_m) * n_kv_heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    past_blocks = past_len // block_n
    num_splits = 1
    if programs < sms and past_blocks >= 8:  # flash decoding: fill the SMs, >= 4 past blocks per split
        num_splits = max(1, min(triton.cdiv(2 * sms, programs), past_blocks // 4, 64))
    return TreeAttentionConfig(block_m, block_n, num_warps, num_stages, num_splits)


def pack_ancestor_bits(ancestors: torch.Tensor) -> torch.Tensor:
    """bool [N, N] -> int32 [N, ceil(N / 32)]: bit j % 32 of word j // 32 in row i is ancestors[i, j]."""
    if ancestors.dim() != 2 or ancestors.shape[0] != ancestors.shape[1]:
        raise ValueError(f"ancestors must be a square [N, N] matrix, got {tuple(ancestors.shape)}")
    n = ancestors.shape[0]
    words = triton.cdiv(n, 32)
    padded = torch.zeros(n, words * 32, dtype=torch.int64, device=ancestors.device)
    padded[:, :n] = ancestors.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=ancestors.device) << torch.arange(32, device=ancestors.device)
    packed = (padded.view(n, words, 32) * weights).sum(-1)  # [N, W] in [0, 2**32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_ancestor_bits(bits: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """int32 [N, W] -> bool [N, N] (inverse of pack_ancestor_bits)."""
    n = bits.shape[0] if n is None else n
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    unpacked = ((bits.to(torch.int32)[:, :, None] >> shifts) & 1).bool()  # [N, W, 32]
    return unpacked.reshape(bits.shape[0], -1)[:, :n]


def _check_inputs(q, k, v, past_len, anc_bits):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D [H, len, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    hq, n, d = q.shape
    hkv, t, dk = k.shape
    if tuple(v.shape) != (hkv, t, dk):
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, k/v have {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if n < 1:
        raise ValueError("need at least one tree node")
    if isinstance(past_len, torch.Tensor):  # read by the kernel: only its form can be checked here
        if past_len.dtype != torch.int32 or past_len.numel() != 1 or past_len.device != q.device:
            raise ValueError(f"a device past_len must be one int32 on {q.device}, got {past_len.dtype} "
                             f"{tuple(past_len.shape)} on {past_len.device}")
        if t < n:
            raise ValueError(f"k/v have {t} rows, fewer than the N = {n} new rows")
    elif past_len < 0 or t < past_len + n:
        raise ValueError(f"k/v have {t} rows but past_len + N = {past_len} + {n} rows are needed")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if anc_bits.dtype != torch.int32 or tuple(anc_bits.shape) != (n, triton.cdiv(n, 32)):
        raise ValueError(f"anc_bits must be int32 [{n}, {triton.cdiv(n, 32)}], got {anc_bits.dtype} "
                         f"{tuple(anc_bits.shape)}")
    if not (q.device == k.device == v.device == anc_bits.device):
        raise ValueError("q, k, v and anc_bits must be on the same device")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError("tree_attention needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int | torch.Tensor,
                   anc_bits: torch.Tensor, scale: float | None = None, *, out: torch.Tensor | None = None,
                   config: TreeAttentionConfig | None = None, causal_tree: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + tree mask) v for q [Hq, N, D], k/v [Hkv, T >= past + N, D] -> [Hq, N, D].

    past_len: an int, or an int32 tensor [1] on q's device that the kernel reads when it runs, so that one
    captured CUDA graph serves every past length (the caller keeps past + N <= T: nothing can check it here).
    Then the split-K count is fixed for the largest past that fits (T - N), and splits beyond the past's end
    exit at once.
    causal_tree=True promises lower-triangular bits (always true for DDTree trees and chains) and lets
    the kernel skip tree key blocks beyond each tile's last node; leave False for arbitrary masks.
    out: optional preallocated [Hq, N, D] output in q's dtype (any strides).
    """
    _check_inputs(q, k, v, past_len, anc_bits)
    hq, n, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif tuple(out.shape) != (hq, n, d) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} [{hq}, {n}, {d}] on {q.device}")
    scale = d ** -0.5 if scale is None else float(scale)
    on_device = isinstance(past_len, torch.Tensor)
    longest = k.shape[1] - n if on_device else past_len
    cfg = config or select_config(group * n, longest, d, hkv, q.device, q.element_size())
    if cfg.block_n < 32 or cfg.block_n % 32 or cfg.block_m < 16:
        raise ValueError(f"config needs block_n a multiple of 32 and block_m >= 16, got {cfg}")
    block_d = max(16, triton.next_power_of_2(d))
    past_blocks = triton.cdiv(longest, cfg.block_n)
    splits = max(1, min(cfg.num_splits, past_blocks))
    blocks_per_split = triton.cdiv(past_blocks, splits) if past_blocks else 0
    if splits > 1 and not on_device:
        splits = triton.cdiv(past_blocks, blocks_per_split)  # every split owns >= 1 past block
    split = splits > 1
    if split:
        part_o = torch.empty(splits, hq, n, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, hq, n, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    grid = (triton.cdiv(group * n, cfg.block_m), hkv, splits)
    _tree_attention_kernel[grid](
        q, k, v, anc_bits, out, part_o, part_lse, past_len if on_device else anc_bits,
        *q.stride(), *k.stride(), *v.stride(), *anc_bits.stride(), *out.stride(),
        0 if on_device else past_len, n, blocks_per_split, scale * _LOG2E,
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        SPLIT=split, CAUSAL_TREE=causal_tree,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 or _interpreting() else "tf32",
        UPCAST=q.dtype != torch.float32 and _interpreting(), PAST_ON_DEVICE=on_device,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        _combine_kernel[(hq * n,)](
            part_o, part_lse, out, splits, n, hq * n, *out.stride(),
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4,
        )
    return out


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int,
                             ancestors_or_bits: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Plain PyTorch fp32 reference. ancestors_or_bits: bool [N, N] or packed int32 [N, ceil(N / 32)]."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    scale = d ** -0.5 if scale is None else float(scale)
    anc = ancestors_or_bits
    if anc.dtype != torch.bool:
        anc = unpack_ancestor_bits(anc, n)
    visible = torch.cat([torch.ones(n, past_len, dtype=torch.bool, device=q.device), anc.to(q.device)], dim=1)
    kf = k[:, : past_len + n].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, past + N, D]
    vf = v[:, : past_len + n].float().repeat_interleave(hq // hkv, dim=0)
    scores = torch.einsum("hnd,htd->hnt", q.float(), kf) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,htd->hnd", scores.softmax(-1), vf).to(q.dtype)
