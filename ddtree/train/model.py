"""The drafter's TRAINING forward: many anchored blocks of one sequence in one pass, with their loss.

For a sequence of T tokens with target tap features F [T, taps*H] and anchors a_1..a_A:
    block j     = [token_{a_j}, MASK x (B-1)] at positions a_j .. a_j+B-1
    context     = fc + hidden_norm of F, rows 0..T-1 at positions 0..T-1 (NOT input_layernorm'd)
    visibility  = block j's rows see context rows < a_j and block j's own rows (both ways), nothing else
    labels      = tokens a_j+1 .. a_j+B-1 (block position k predicts token a_j+k; the anchor has no loss)
Exactly what DFlashDrafter.add_context(features[:a]) + draft(bonus=token_a) computes, for every block at once.

Several sequences can share one pass (packing, for GPUs, where a pass per sequence is launch-bound): their
tokens, features and teacher rows are concatenated, `bounds` [S+1] holds where each sequence starts, anchors are
in packed coordinates, and a block sees only its own sequence's context, at that sequence's positions. The loss
is then the SUM over the pack's sequences of each one's weighted mean, so a packed pass computes what the
sequences' separate passes add up to.

Attention is computed in two parts instead of one [A*B, T + A*B] masked matrix: block rows against the
context ([A, B, T], masked by t < a_j) and block rows against their own block ([A, B, B], all visible),
joined in one softmax. `visibility_mask` builds the equivalent dense mask (used by the tests).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.attention import Visibility
from ..models.markov import row_log_likelihood
from ..models.protocol import reference
from .fused_ce import head_acceptance_loss, head_soft_cross_entropy, merge_duplicate_ids


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Weight of block position k = 1..B-1: exp(-(k-1)/gamma). Returns [B-1]."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """The published decay: 7 for B=16, 5 for B=10, 4 for B=8; in between, linear in B."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0))


def sample_anchors(prompt_len: int, seq_len: int, max_anchors: int, generator: torch.Generator,
                   include_prompt: bool = False) -> torch.Tensor:
    """Up to max_anchors distinct anchors, sorted. An anchor needs a >= 1 (some context) and a <= T-2 (at
    least one label); by default it lies in the response (a >= prompt_len), as the bonus token does in
    decoding. Blocks running past the end are truncated by label masking. Returns LongTensor [A]."""
    lo = 1 if include_prompt else max(1, prompt_len)
    hi = seq_len - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    n = hi - lo + 1
    pick = torch.randperm(n, generator=generator)[:max_anchors] + lo
    return pick.sort().values


def spans(anchors: torch.Tensor, seq_len: int, bounds: torch.Tensor | None = None):
    """Packing bookkeeping. bounds [S+1] (None = one sequence [0, T]). Returns per anchor its sequence index,
    start and end [A], and per context row its position within its own sequence [T]."""
    rows = torch.arange(seq_len, device=anchors.device)
    if bounds is None:
        zero = torch.zeros_like(anchors)
        return zero, zero, torch.full_like(anchors, seq_len), rows
    bounds = bounds.to(anchors.device)
    seq = torch.searchsorted(bounds[1:], anchors, right=True)
    row_seq = torch.searchsorted(bounds[1:], rows, right=True)
    return seq, bounds[seq], bounds[seq + 1], rows - bounds[row_seq]


def _context_visible(anchors: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[A, T]: block j sees context row t iff start_j <= t < a_j (its own sequence, before its anchor)."""
    t = torch.arange(seq_len, device=anchors.device)[None, :]
    return (t < anchors[:, None]) & (t >= starts[:, None])


def visibility_mask(anchors: torch.Tensor, seq_len: int, block_size: int,
                    starts: torch.Tensor | None = None) -> torch.Tensor:
    """Dense boolean mask [A*B, T + A*B]: query row (j, i) sees context row t iff start_j <= t < a_j, and block
    row (j', i') iff j' == j."""
    a, b = anchors.numel(), block_size
    ctx = _context_visible(anchors, torch.zeros_like(anchors) if starts is None else starts, seq_len)  # [A, T]
    ctx = ctx.repeat_interleave(b, dim=0)  # [A*B, T]
    owner = torch.arange(a, device=anchors.device).repeat_interleave(b)  # [A*B]
    return torch.cat([ctx, owner[:, None] == owner[None, :]], dim=1)


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 ends: torch.Tensor | None = None):
    """tokens [T], anchors [A] -> block tokens [A, B], positions [A, B] (packed coordinates), labels [A, B-1]
    (-100 past the end of the anchor's sequence: ends [A], default T)."""
    seq_len = tokens.numel()
    offsets = torch.arange(block_size, device=tokens.device)
    positions = anchors[:, None] + offsets[None, :]  # [A, B]
    block = torch.full(positions.shape, mask_token_id, dtype=torch.long, device=tokens.device)
    block[:, 0] = tokens[anchors]
    target_pos = positions[:, 1:]
    labels = tokens[target_pos.clamp(max=seq_len - 1)]
    end = seq_len if ends is None else ends[:, None]
    labels = labels.masked_fill(target_pos >= end, -100)  # a block running past the end: no label there
    return block, positions, labels


def _attend_split(q, kc, vc, kb, vb, anchors, starts, block_size):
    """q [Hq, A*B, D]; context kc, vc [Hkv, T, D]; block kb, vb [Hkv, A*B, D]; starts [A]. Returns [Hq, A*B, D]."""
    hq, n, d = q.shape
    hkv, seq_len, _ = kc.shape
    a, b, g = anchors.numel(), block_size, hq // hkv
    q = q.view(hkv, g, a, b, d)
    kb, vb = kb.view(hkv, a, b, d), vb.view(hkv, a, b, d)
    scale = 1.0 / math.sqrt(d)
    s_ctx = torch.einsum("hgabd,htd->hgabt", q, kc) * scale  # [Hkv, g, A, B, T]
    visible = _context_visible(anchors, starts, seq_len)  # [A, T]
    s_ctx = s_ctx.masked_fill(~visible[:, None, :], float("-inf"))
    s_blk = torch.einsum("hgabd,hacd->hgabc", q, kb) * scale  # [Hkv, g, A, B, B]
    p = torch.cat([s_ctx, s_blk], dim=-1).float().softmax(dim=-1).to(q.dtype)
    out = torch.einsum("hgabt,htd->hgabd", p[..., :seq_len], vc)
    out = out + torch.einsum("hgabc,hacd->hgabd", p[..., seq_len:], vb)
    return out.reshape(hq, n, d)


def _attend_dense(q, kc, vc, kb, vb, anchors, starts, block_size):
    """The same attention through SDPA with the dense visibility_mask (the reference for tests)."""
    hq, n, d = q.shape
    hkv = kc.shape[0]
    k, v = torch.cat([kc, kb], dim=1), torch.cat([vc, vb], dim=1)
    k, v = k.repeat_interleave(hq // hkv, dim=0), v.repeat_interleave(hq // hkv, dim=0)
    mask = visibility_mask(anchors, kc.shape[1], block_size, starts)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]


def drafter_block_hidden(drafter, features: torch.Tensor, block: torch.Tensor, positions: torch.Tensor,
                         anchors: torch.Tensor, embed: nn.Module, dense: bool = False,
                         bounds: torch.Tensor | None = None) -> torch.Tensor:
    """features [T, taps*H]; block tokens / positions [A, B] (packed coordinates); bounds [S+1] for a pack.
    Returns the final-normed hidden [A, B, H]."""
    drafter = reference(drafter)
    a, b = block.shape
    seq_len = features.shape[0]
    _, starts, _, ctx_positions = spans(anchors, seq_len, bounds)
    ctx = drafter.hidden_norm(drafter.fc(features))  # [T, H]
    cos_c, sin_c = drafter.rotary(ctx_positions, ctx.dtype)  # each row at its position in its own sequence
    h = embed(block.reshape(-1)).to(ctx.dtype)  # [A*B, H]
    cos_b, sin_b = drafter.rotary((positions - starts[:, None]).reshape(-1), h.dtype)
    attend = _attend_dense if dense else _attend_split
    for layer in drafter.layers:
        kc, vc = layer.self_attn.key_value(ctx, cos_c, sin_c)  # the context's K/V in this layer [Hkv, T, D]
        # block queries [Hq, A*B, D] see the context before their anchor and their own block's K/V
        h = layer(h, cos_b, sin_b, lambda q, kb, vb, kc=kc, vc=vc: attend(q, kc, vc, kb, vb, anchors, starts, b))
    return drafter.norm(h).view(a, b, -1)


def target_to_draft(drafter) -> torch.Tensor | None:
    """[target vocab] long: each target id's draft id, -1 outside the draft vocabulary (None: the full vocabulary,
    ids are the same)."""
    if not drafter.cfg.reduced_vocab:
        return None
    draft_ids = torch.arange(drafter.cfg.draft_vocab_size, device=drafter.d2t.device)
    t2d = torch.full((drafter.cfg.model.vocab_size,), -1, dtype=torch.long, device=drafter.d2t.device)
    t2d[draft_ids + drafter.d2t] = draft_ids
    return t2d


def draft_head(drafter, target) -> torch.Tensor:
    """The LM head the drafter predicts with: its own over a reduced vocabulary, else the target's."""
    return reference(drafter).lm_head.weight if drafter.cfg.reduced_vocab else reference(target).lm_head.weight


OBJECTIVES = ("ce", "tv", "ce+tv")  # DraftLoss's training objectives


class DraftLoss(nn.Module):
    """Wraps the drafter for training (and DistributedDataParallel): forward(one sequence) -> weighted loss.
    The target's embedding and LM head are used frozen; they are not submodules, so no optimizer sees them.

    Loss per label (objective "ce"): (1 - distill) * CE(label) + distill * CE(teacher), the teacher being the
    target's own next-token distribution there (its top-k, renormalized): distill = 0 is the published hard-label
    recipe, 1 is pure distillation (KL to the teacher up to its entropy). "tv": the total-variation distance
    between the draft's distribution and the same mix p = (1 - distill) onehot(label) + distill teacher, i.e.
    1 - sum min(p, q), the rejection probability of speculative sampling (with distill = 0: 1 - q(label)).
    "ce+tv": their sum. With a reduced draft vocabulary the head is the drafter's own (frozen, rows of the
    target's) and targets outside the draft vocabulary carry no weight (a label outside it counts as a miss in
    the accuracy).

    markov_weight > 0 (a drafter with a Markov head, ddtree/models/markov.py) adds that weight times the head's
    teacher-forced NLL, -log cond(label | the true previous token), at block positions 2..B-1 (position 1 has no
    bias), with the same position weights: the drafter and its head trained together, each block position's
    candidates taken from the drafter's live log-probs as markov-fit takes them from its tables."""

    def __init__(self, drafter, target, gamma: float | None = None, distill: float = 0.0, objective: str = "ce",
                 markov_weight: float = 0.0):
        super().__init__()
        if not 0.0 <= distill <= 1.0:
            raise ValueError(f"distill must be within [0, 1], got {distill}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if markov_weight < 0 or (markov_weight > 0 and drafter.markov is None):
            raise ValueError(f"markov_weight must be >= 0 and needs a drafter with a Markov head, got {markov_weight} "
                             f"for a drafter {'with' if drafter.markov is not None else 'without'} one")
        drafter, target = reference(drafter), reference(target)  # the modules themselves: trained, or frozen
        self.drafter, self.distill, self.objective, self.markov_weight = drafter, distill, objective, markov_weight
        self._frozen = (target.requires_grad_(False),)  # kept out of the module tree: never trained
        b = drafter.cfg.block_size
        self.register_buffer("weights", loss_weights(b, default_gamma(b) if gamma is None else gamma), persistent=False)
        self.register_buffer("t2d", target_to_draft(drafter), persistent=False)

    @property
    def target(self):
        return self._frozen[0]

    def _head(self) -> torch.Tensor:
        return draft_head(self.drafter, self.target)

    def _to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.t2d is None else self.t2d[ids]

    def _markov_nll(self, h: torch.Tensor, label: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor):
        """The head's -log cond(label | parent) [n] for hidden rows h [n, H], draft labels [n] (>= 0), parents'
        target ids [n] and depth indices [n] (block position - 1, all >= 1). The rows' full log-probs [n, V] are
        kept for the backward pass: fine for a reduced draft vocabulary, heavy for a full one."""
        head = self.drafter.markov
        lp = (h @ self._head().detach().T).float().log_softmax(dim=-1)  # [n, V]; the LM head stays frozen
        top = lp.topk(min(head.candidates, lp.shape[-1]), dim=-1)  # [n, M]
        hit = top.indices == label[:, None]
        label_idx = torch.where(hit.any(-1), hit.long().argmax(-1), -1)
        label_lp = lp.gather(1, label[:, None])[:, 0]
        return -row_log_likelihood(head, self.target.model.embed_tokens.weight, top.values, top.indices, label_idx,
                                   label_lp, parents, depths)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, dense: bool = False,
                teacher: tuple[torch.Tensor, torch.Tensor] | None = None, bounds: torch.Tensor | None = None):
        """tokens [T]; features [T, taps*H]; anchors [A]; teacher = (log-probs, ids) [T, K] of the target's
        top-k next-token distribution after each token (needed when distill > 0); bounds [S+1] for a pack of S
        sequences (default: one). Returns (loss, stats): the loss is the sum over sequences of each one's
        weighted mean; stats = weighted-loss sum, weight sum, correct top-1 count and label count, and the head's
        weighted NLL sum and weight sum (zero without markov_weight) (no grad)."""
        cfg = self.drafter.cfg
        seq, _, ends, _ = spans(anchors, tokens.numel(), bounds)
        block, positions, labels = block_inputs(tokens, anchors, cfg.block_size, cfg.mask_token_id, ends)
        features = features.to(self.drafter.fc.weight.dtype)  # a bf16 target may train an fp32 drafter
        hidden = drafter_block_hidden(self.drafter, features, block, positions, anchors, self.target.model.embed_tokens,
                                      dense, bounds)
        valid = labels >= 0  # [A, B-1]
        label = self._to_draft(labels[valid])  # [n] draft ids, -1 outside the draft vocabulary
        idx = label.clamp(min=0)[:, None]
        w = ((label >= 0).float() * (1.0 - self.distill))[:, None]  # [n, 1]
        if self.distill > 0:
            if teacher is None:
                raise ValueError("distill > 0 needs the teacher's top-k (FeatureSource with distill_topk > 0)")
            rows = positions[:, 1:][valid] - 1  # the target's prediction for token a+k is made after token a+k-1
            logp, ids = teacher[0][rows].float(), self._to_draft(teacher[1][rows])  # [n, K]
            p = logp.exp() * (ids >= 0)
            p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-12)
            idx, w = torch.cat([idx, ids.clamp(min=0)], dim=1), torch.cat([w, p * self.distill], dim=1)
        # the LM head and the loss in one chunked pass: the [n_valid, V] logits are never kept
        h = hidden[:, 1:][valid]
        if self.objective == "ce":
            loss, hit = head_soft_cross_entropy(h, self._head(), idx, w, label)
        else:
            loss, hit = head_acceptance_loss(h, self._head(), idx, merge_duplicate_ids(idx, w), label)
            if self.objective == "ce+tv":
                loss = loss + head_soft_cross_entropy(h, self._head(), idx, w, label)[0]
        pw = self.weights[None, :].expand_as(labels)[valid] * (w.sum(dim=-1) > 0)
        n_seqs = 1 if bounds is None else bounds.numel() - 1
        owner = seq[:, None].expand_as(labels)[valid]  # [n] the sequence of each label
        num = torch.zeros(n_seqs, device=loss.device, dtype=loss.dtype).index_add(0, owner, loss * pw)
        den = torch.zeros(n_seqs, device=loss.device, dtype=pw.dtype).index_add(0, owner, pw)
        total = (num / den.clamp(min=1e-6)).sum()
        stats = {"ce_sum": (loss * pw).sum().detach(), "w_sum": pw.sum(), "correct": hit.sum(), "labels": valid.sum(),
                 "markov_sum": torch.zeros((), device=loss.device), "markov_w": torch.zeros((), device=loss.device)}
        if self.markov_weight > 0:
            depth = torch.arange(cfg.block_size - 1, device=labels.device).expand_as(labels)[valid]  # [n]
            keep = (label >= 0) & (depth > 0)  # a true draft token, at a position the head biases
            parents = tokens[(positions[:, 1:] - 1).clamp(max=tokens.numel() - 1)][valid]  # [n] token a+k-1 (target id)
            nll = torch.zeros_like(loss)
            nll[keep] = self._markov_nll(h[keep], label[keep], parents[keep], depth[keep]).to(nll.dtype)
            mw = pw * keep
            num = torch.zeros(n_seqs, device=loss.device, dtype=nll.dtype).index_add(0, owner, nll * mw)
            den = torch.zeros(n_seqs, device=loss.device, dtype=mw.dtype).index_add(0, owner, mw)
            total = total + self.markov_weight * (num / den.clamp(min=1e-6)).sum()
            stats.update(markov_sum=(nll * mw).sum().detach(), markov_w=mw.sum())
        return total, stats


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, tap_layers, topk: int = 0):
    """The frozen target's tap features [T, taps*H] for a whole sequence (one causal pass), as an ordinary
    tensor usable in autograd; with topk > 0 also its top-k next-token log-probs and ids [T, K] at every
    position (the distillation teacher): returns (features, (logprobs, ids))."""
    return target_features_packed(target, [tokens], tap_layers, topk)[0]


@torch.no_grad()
def target_features_packed(target, sequences: list[torch.Tensor], tap_layers, topk: int = 0) -> list:
    """target_features of several sequences [T_s] in ONE target pass (a pass per sequence is launch-bound on a
    GPU): concatenated, each at its own positions 0..T_s-1 and seeing only its own earlier tokens (a
    block-diagonal causal mask). Returns one result per sequence, as target_features gives it."""
    lengths = [t.numel() for t in sequences]
    tokens = torch.cat(sequences)
    n, device = tokens.numel(), tokens.device
    positions = torch.cat([torch.arange(k, device=device) for k in lengths])
    if len(sequences) == 1:
        vis = Visibility.causal(0, n, device)
    else:
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                        torch.tensor(lengths, device=device))
        vis = Visibility(0, (owner[:, None] == owner[None, :]).tril_())  # [n, n]
    out = target(tokens, positions, target.new_cache(n), vis, tuple(tap_layers), last_only=topk == 0)
    taps = out.taps.clone().split(lengths)
    if topk == 0:
        return list(taps)
    top = out.logits.float().log_softmax(dim=-1).topk(topk, dim=-1)
    return [(f, (v, i)) for f, v, i in zip(taps, top.values.split(lengths), top.indices.split(lengths))]
