"""The target's token choice at each verified position: argmax at T = 0, else a sample of the processed
distribution (temperature, then top-k, then top-p). Each position is drawn independently, which is what
makes the tree walk lossless: the committed token at every step is the target's own draw given its prefix."""
from __future__ import annotations

import torch

from ..runtime.cpu import qlinear
from ..base.config import SamplingParams

TOP_P_FIRST_K, TOP_P_GROWTH = 64, 8  # nucleus(): the first head of the order sorted, and how much it grows


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] (fp32) after temperature, top-k and top-p."""
    logits = logits.float()
    if params.temperature != 1.0:  # at 1 the division changes no bit and cannot overflow
        scaled = logits / params.temperature
        if torch.isposinf(scaled).any():  # a tiny temperature overflowed: the same distribution, scaled from the max
            scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature  # (the top token(s) at 0)
        logits = scaled
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [N, V] -> the top-p distribution: in descending order, a token is dropped when the mass strictly before
    it already reaches top_p (the top token always stays); renormalized. Only the head of the order is sorted: the
    top k by topk, k growing TOP_P_GROWTH-fold from TOP_P_FIRST_K until those k hold top_p of every row, since every
    token after them is then dropped (a nucleus is mostly a few tokens; sorting a whole vocabulary per draw costs
    more than a decoding step on a CPU: docs/cpu-speed.md)."""
    vocab = probs.shape[-1]
    k = min(vocab, TOP_P_FIRST_K)
    while True:
        head, order = probs.topk(k, dim=-1)  # [N, k], descending
        mass = head.cumsum(dim=-1)  # the mass up to and including each
        if k == vocab or bool((mass[..., -1] >= top_p).all()):
            break
        k = min(vocab, TOP_P_GROWTH * k)
    head = head.masked_fill(mass - head >= top_p, 0.0)  # the mass strictly before it
    kept = torch.zeros_like(probs).scatter_(-1, order, head)
    return kept / kept.sum(dim=-1, keepdim=True)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> torch.argmax(logits, -1): through the CPU kernel for float32 CPU logits (a vectorized pass,
    where torch's reduction is slow over a large vocabulary; the same index), else torch."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2 and qlinear.cpu_kernel_available():
        return qlinear.kernel().argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> one draw per row, LongTensor [N]. On a CPU through the kernel's inverse CDF (one uniform per
    row, double sums, one scan, where torch.multinomial draws an exponential per entry), else torch."""
    if probs.dtype == torch.float32 and probs.device.type == "cpu" and probs.dim() == 2 and qlinear.cpu_kernel_available():
        u = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64)
        return qlinear.kernel().sample_rows(probs, u)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> the target's token at each of the N positions, LongTensor [N]."""
    if params.greedy:
        return argmax(logits)
    return sample(processed_probs(logits, params), generator)
