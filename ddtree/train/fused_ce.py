"""Cross-entropy through a frozen LM head, in row chunks, without keeping the [N, V] logits.

Training the drafter is dominated by its LM head (the target's, 49K x 576 for SmolLM2): the matmul is fast in
bf16, but the float softmax, its backward and the dtype copies over a [N, V] matrix are memory-bound passes
that took ~70% of a step. Here each chunk of rows computes logits once in the forward (logsumexp, label
logit, argmax) and once more in the backward (softmax - onehot, then grad_hidden = dlogits @ W), so only
[N] values are saved and every pass runs over a cache-sized [chunk, V] block. The head is frozen: no weight
gradient is formed.
"""
from __future__ import annotations

import torch

CHUNK_ROWS = 256  # [256, 49152] fp32 = 48 MB per block
# exp() of arguments below about -88 (results that underflow float32) runs far slower on x86 CPUs, and an
# untrained drafter's logits span hundreds: clamping there first changes each probability by < 2e-35.
EXP_FLOOR = -80.0


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor):
    """A chunk's logits hidden [c, H] @ weight.T, not kept: (their values at idx [c, K], logsumexp [c], argmax [c])."""
    logits = (hidden @ weight.T).float()  # [c, V]
    chosen = logits.gather(1, idx)
    top, arg = logits.max(dim=-1)
    lse = top + logits.sub_(top[:, None]).clamp_(min=EXP_FLOOR).exp_().sum(dim=-1).log_()
    return chosen, lse, arg


class _HeadLoss(torch.autograd.Function):
    """A per-row loss of q = softmax(hidden @ weight.T) against targets w over ids idx, chunk by chunk:
    - cross-entropy (tv False): -sum_k w_k log q[idx_k]. Hard CE is one target of weight 1; distillation is the
      teacher's top-k probabilities (mixed with the hard label).
    - total variation (tv True): sum_k w_k - sum_k min(w_k, q[idx_k]), ids distinct where w > 0: with w the
      target's next-token distribution, the probability that a token drawn from q is rejected (speculative
      sampling's acceptance is one minus it)."""

    @staticmethod
    def forward(ctx, hidden, weight, idx, w, labels, chunk, tv):
        # hidden [N, H] (the head's dtype), weight [V, H], idx [N, K], w [N, K] fp32, labels [N]
        #   -> loss [N] fp32, correct [N] bool (argmax == label)
        n = hidden.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
        correct = torch.empty(n, dtype=torch.bool, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            chosen, lse[s:e], arg = _chunk_logits(hidden[s:e], weight, idx[s:e])
            if tv:
                q = chosen.sub_(lse[s:e, None]).clamp_(min=EXP_FLOOR).exp_()
                loss[s:e] = w[s:e].sum(dim=-1) - torch.minimum(q, w[s:e]).sum(dim=-1)
            else:
                loss[s:e] = lse[s:e] * w[s:e].sum(dim=-1) - (chosen * w[s:e]).sum(dim=-1)
            correct[s:e] = arg == labels[s:e]
        ctx.save_for_backward(hidden, weight, idx, w, lse)
        ctx.chunk, ctx.tv = chunk, tv
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        hidden, weight, idx, w, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, hidden.shape[0])
            probs = (hidden[s:e] @ weight.T).float().sub_(lse[s:e, None]).clamp_(min=EXP_FLOOR).exp_()  # softmax [c, V]
            if ctx.tv:  # d loss / d logit_j = q_j * sum_{k in A} q_k - [j in A] q_j, A: where q < w (min takes q)
                q = probs.gather(1, idx[s:e])
                taken = q * (q < w[s:e])  # [c, K]
                probs.mul_(taken.sum(dim=-1, keepdim=True)).scatter_add_(1, idx[s:e], -taken)
            else:  # d loss / d logit_j = q_j * sum_k w_k - sum_k w_k [idx_k == j]
                probs.mul_(w[s:e].sum(dim=-1, keepdim=True)).scatter_add_(1, idx[s:e], -w[s:e])
            probs.mul_(grad_loss[s:e, None])
            grad_hidden[s:e] = probs.to(weight.dtype) @ weight
        return grad_hidden, None, None, None, None, None, None


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of softmax(hidden @ weight.T) at labels, and whether the argmax hits the label.
    hidden [N, H], weight [V, H] (frozen), labels [N] in [0, V). Returns (ce [N] fp32, correct [N] bool);
    ce is differentiable with respect to hidden only."""
    ones = torch.ones(labels.shape[0], 1, dtype=torch.float32, device=labels.device)
    return head_soft_cross_entropy(hidden, weight, labels[:, None], ones, labels, chunk)


def head_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                            labels: torch.Tensor, chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row -sum_k w[:, k] * log softmax(hidden @ weight.T)[idx[:, k]] (a KL divergence up to the targets'
    own entropy when w holds a distribution), and whether the argmax hits `labels` (-1: never).
    hidden [N, H], weight [V, H] (frozen), idx [N, K] in [0, V), w [N, K] >= 0. Returns (loss [N] fp32,
    correct [N] bool); loss is differentiable with respect to hidden only."""
    return _HeadLoss.apply(hidden.to(weight.dtype), weight.detach(), idx, w.float(), labels, chunk, False)


def merge_duplicate_ids(idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Weights w [N, K] over ids idx [N, K] with each id's total kept at its first column and 0 at its repeats
    (a hard label is usually also among the teacher's top-k): the distribution head_acceptance_loss needs."""
    k = idx.shape[1]
    same = idx[:, :, None] == idx[:, None, :]  # [N, K, K]
    earlier = torch.ones(k, k, dtype=torch.bool, device=idx.device).tril(-1)  # [k, j]: j < k
    first = ~(same & earlier).any(dim=-1)
    return (same * w[:, None, :]).sum(dim=-1) * first


def head_acceptance_loss(hidden: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                         labels: torch.Tensor, chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row rejection probability sum(w) - sum_k min(w[:, k], softmax(hidden @ weight.T)[idx[:, k]]) (the
    total-variation distance to the target distribution w; ids repeated within a row must be merged first:
    merge_duplicate_ids), and whether the argmax hits `labels` (-1: never). Shapes as head_soft_cross_entropy's;
    differentiable with respect to hidden only."""
    return _HeadLoss.apply(hidden.to(weight.dtype), weight.detach(), idx, w.float(), labels, chunk, True)
