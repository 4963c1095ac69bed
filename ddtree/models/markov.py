"""Parent-conditioned draft distributions: an optional Markov head on a DFlash drafter, and trees built from it.

A DFlash block pass gives ONE distribution per block position, whatever token its parent in a tree is: a sibling
branch (parent = the rank-1 token) gets the same continuation as the spine. The Markov head adds a low-rank bias
from the parent token to the next position's logits, so every tree node's children come from ITS conditional:

    cond_d(v | u) = exp(lp_d(v) + b_d(u, v) [v in C_d]) / Z_d(u),   b_d(u, v) = scale_d * (E[u] P) . Q[:, v]

lp_d: the drafter's log-probs at block position d (1-based), C_d: their top-M candidates (draft ids), u: the
parent's target token id, E: the target's input embedding (frozen), P [H, r] and Q [r, draft vocab]: the head.
Position 1 gets no bias (b_1 = 0): its parent is the root, which the block pass already reads as its first
token, so a bias there counts it twice (it lowered position 1's accuracy: RECIPE.md). Tokens outside C_d keep
their own probability (the bias is applied among the candidates only), so
Z_d(u) = (1 - sum_{v in C_d} p_d(v)) + sum_{v in C_d} exp(lp_d(v) + b_d(u, v)):
all the work is [depth, M, M], never a pass over the vocabulary per node. Q starts at zero: a fresh head is the
identity. Training fits P, Q and the per-depth scales teacher-forced (a node can only be accepted when its parent
was, so the true previous token is the parent that matters): on a frozen drafter from cached tables
(ddtree/train/markov.py), or together with the drafter (`fit --markov-weight`, ddtree/train/model.py).

Only which tokens the tree holds changes: verification and the walk are untouched, so decoding stays exactly
lossless with or without the head. A drafter without one drafts exactly as before.
"""
from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import nn


# config.json key: {"rank": r, "candidates": M}. A top-level key, outside dflash_config, so that other engines
# reading the published format (vLLM, SGLang) never see it; its tensors are extra names they do not load.
CONFIG_KEY = "markov_head"


class MarkovHead(nn.Module):
    """b_d(u, v) = scale[d - 1] * (E[u] @ proj) . out[:, v] for block positions d = 1..positions."""

    def __init__(self, hidden_size: int, draft_vocab: int, positions: int, rank: int = 64, candidates: int = 32,
                 loaded: bool = False):
        """loaded: its weights are loaded next (DFlashDrafter.on_meta): proj is left uninitialized."""
        super().__init__()
        if rank < 1 or candidates < 1:
            raise ValueError(f"markov head rank and candidates must be >= 1, got {rank} and {candidates}")
        self.rank, self.candidates = rank, candidates
        proj = torch.empty(hidden_size, rank) if loaded else torch.randn(hidden_size, rank) * hidden_size ** -0.5
        self.proj = nn.Parameter(proj)  # [H, r]
        self.out = nn.Parameter(torch.zeros(rank, draft_vocab))  # [r, draft vocab]: zero = no bias
        self.scale = nn.Parameter(torch.ones(positions))  # [block_size - 1]
        self._host = None  # (weights' key, tensors, arrays): host_tensors' (codes, out.T, scales), made on first use

    def code(self, parent_emb: torch.Tensor) -> torch.Tensor:
        """Parents' target embeddings [..., H] -> their codes [..., r]."""
        return parent_emb.to(self.proj.dtype) @ self.proj

    def bias(self, codes: torch.Tensor, cand_ids: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """codes [..., P, r] (the parents'), cand_ids [..., M] draft ids, depths [...] (block position - 1).
        Returns b [..., P, M]."""
        w = self.out.T[cand_ids]  # [..., M, r]
        return self.depth_scales()[depths][..., None, None] * (codes @ w.transpose(-1, -2))

    def depth_scales(self) -> torch.Tensor:
        """scale_d per depth [positions], with position 1's zero (no bias there: see the module doc)."""
        return torch.cat([torch.zeros_like(self.scale[:1]), self.scale[1:]])

    @torch.inference_mode()
    def host_tensors(self, embed, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tree building on the host (conditional_table, the CPU kernel's markov_tree): every target token's code
        [vocab, r] (embed: the target's embedding, called on all ids once), out.T [draft vocab, r] and the per-depth
        scales [positions] with position 1's zero, as contiguous float32 CPU tensors; remade when a weight of the
        head changes."""
        key = tuple((t._version, t.data_ptr()) for t in (self.proj, self.out, self.scale)) + (embed,)
        if self._host is None or self._host[0] != key:
            ids = torch.arange(vocab, device=self.proj.device)
            codes = torch.cat([self.code(embed(ids[i:i + 8192])) for i in range(0, vocab, 8192)])
            tensors = tuple(t.float().cpu().contiguous() for t in (codes, self.out.T, self.depth_scales()))
            self._host = (key, tensors, tuple(t.numpy() for t in tensors))
        return self._host[1]

    def host_tables(self, embed, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """host_tensors as numpy arrays (the same memory)."""
        self.host_tensors(embed, vocab)
        return self._host[2]


def conditional_logprobs(head: MarkovHead, cand_lp: torch.Tensor, cand_ids: torch.Tensor, codes: torch.Tensor,
                         depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's conditionals among the candidates. cand_lp / cand_ids [..., M]: a position's top-M log-probs
    and draft ids; codes [..., P, r]: the parents' (head.code); depths [...]. Returns (cond [..., P, M] log
    cond(v | u) for v in C, log Z [..., P]: a token w outside C has log cond(w | u) = lp(w) - log Z). Shared by
    training and tree building."""
    cand_lp = cand_lp.float()
    rest = (-torch.expm1(cand_lp.logsumexp(-1).clamp(max=0))).clamp(min=1e-12).log()  # [...] log(1 - sum p)
    x = cand_lp[..., None, :] + head.bias(codes, cand_ids, depths).float()  # [..., P, M]
    norm = torch.logaddexp(rest[..., None], x.logsumexp(-1))  # [..., P]
    return x - norm[..., None], norm


def row_log_likelihood(head: MarkovHead, embed: torch.Tensor, cand_lp, cand_ids, label_idx, label_lp, parents,
                       depths) -> torch.Tensor:
    """log cond(label | parent) [n] of n teacher-forced (root, depth) rows. cand_lp / cand_ids [n, M]: the drafter's
    top-M log-probs and draft ids there; label_idx [n]: the true token's index among them (-1: not one), label_lp [n]:
    its log-prob; parents [n]: the true previous tokens (target ids); depths [n]; embed: the target's input embedding
    [V, H]. The loss of markov-fit (from cached tables) and of `fit --markov-weight` (live, with the drafter)."""
    cond, norm = conditional_logprobs(head, cand_lp, cand_ids, head.code(embed[parents])[:, None, :], depths)
    cond, norm = cond[:, 0], norm[:, 0]  # one parent per row
    inside = cond.gather(1, label_idx.clamp(min=0)[:, None])[:, 0]
    return torch.where(label_idx >= 0, inside, label_lp - norm)


@torch.inference_mode()
def conditional_table(drafter, logprobs: torch.Tensor, root: int, m: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """For a block's log-probs [D, V] (positions 1..D) and the root's target id: per depth d the candidates' draft
    ids [D, M] and the conditionals cond [D, M, M] (float64): row p of depth d is cond(. | candidate p of depth d - 1)
    over depth d's candidates; at depth 0 every row is cond(. | root) (one shape at every depth: one batched matmul).
    conditional_logprobs' arithmetic in numpy on the host, in double like the CPU kernel's markov_tree (so the two
    pop the same trees; tests/test_markov.py holds all three equal): a few [D, M, M] operations, where torch's
    per-op overhead would be most of the time."""
    head = drafter.markov
    d, _ = logprobs.shape
    m = candidate_count(head, m, logprobs.shape[1])
    top = logprobs.topk(m, dim=-1)  # [D, M]
    parents = drafter.to_target_ids(top.indices[:-1])  # [D - 1, M]: depth d's parents are depth d - 1's candidates
    cand_lp, cand_ids, parents = (t.cpu().numpy() for t in (top.values.float(), top.indices, parents))
    codes, out_t, scale = head.host_tables(drafter.target.embed, drafter.cfg.model.vocab_size)
    cand_lp = cand_lp.astype(np.float64)
    z = np.empty((d, m, codes.shape[1]), dtype=np.float64)  # [D, M, r] the parents' codes
    z[0] = codes[root]
    z[1:] = codes[parents]
    w = out_t[cand_ids].astype(np.float64)  # [D, M, r] the candidates' output rows
    x = cand_lp[:, None, :] + scale[:d, None, None].astype(np.float64) * (z @ w.transpose(0, 2, 1))  # [D, M, M]
    rest = np.maximum(-np.expm1(_logsumexp(cand_lp)), 1e-12)  # [D] the mass outside the candidates
    norm = np.log(rest[:, None] + np.exp(_logsumexp(x)))  # [D, M]
    return cand_ids, x - norm[..., None]


def candidate_count(head: MarkovHead, m: int | None, vocab: int) -> int:
    """M, the candidates per block position: m (None: the head's own), at most the head's and the vocabulary's."""
    return min(m or head.candidates, head.candidates, vocab)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1)
    return top + np.log(np.exp(x - top[..., None]).sum(axis=-1))


def conditional_best_first(cand_ids: np.ndarray, cond: np.ndarray, budget: int
                           ) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
    """tree.best_first_nodes with each node's children drawn from its own conditional (conditional_table's
    output). Same contract: parents / depths [n + 1] (root included), the n nodes' draft ids and path
    log-probs, in pop order (non-increasing: any prefix is a tree). A node's children are at most M."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    max_depth, m = cand_ids.shape
    rows: dict[tuple[int, int], tuple[list, list]] = {}

    def row(d: int, p: int) -> tuple[list, list]:  # parent row p at depth d: (log-probs, candidates), best first
        if (d, p) not in rows:  # sorted on first use: a tree reads few of the D x M rows
            order = np.argsort(-cond[d, p], kind="stable")
            rows[d, p] = cond[d, p][order].tolist(), order.tolist()
        return rows[d, p]

    parents, depths, tokens, scores = [-1], [0], [], []
    lp0, _ = row(0, 0)
    # heap entries: (-score, parent node, depth index d, parent row p, rank r among row (d, p))
    heap = [(-lp0[0], 0, 0, 0, 0)]
    while heap and len(tokens) < budget:
        neg, parent, d, p, r = heapq.heappop(heap)
        lp, idx = row(d, p)
        node, c = len(parents), idx[r]
        parents.append(parent)
        depths.append(d + 1)
        tokens.append(int(cand_ids[d, c]))
        scores.append(-neg)
        if r + 1 < m:  # next sibling: same parent, next rank of its conditional
            heapq.heappush(heap, (neg + lp[r] - lp[r + 1], parent, d, p, r + 1))
        if d + 1 < max_depth:  # first child: the best of this node's own conditional
            heapq.heappush(heap, (neg - row(d + 1, c)[0][0], node, d + 1, c, 0))
    return (np.asarray(parents, dtype=np.int64), np.asarray(depths, dtype=np.int64), tokens,
            np.asarray(scores, dtype=np.float64))


def conditional_chain(cand_ids: np.ndarray, cond: np.ndarray) -> list[int]:
    """The spine: at each depth the best candidate given the one drafted before it (draft ids [D])."""
    out, p = [], 0
    for d in range(cand_ids.shape[0]):
        p = int(np.argmax(cond[d, p]))
        out.append(int(cand_ids[d, p]))
    return out


# A tree of at most this many nodes draws on this many candidates per position (not the head's M): small trees rarely
# reach past them (RECIPE.md compares 8 with 32 on held-out answers), and the host's work per step grows as M^2.
SMALL_TREE_CANDIDATES = 8


def _kernel_args(drafter, logprobs: torch.Tensor, kernel) -> tuple | None:
    """The head's host tables and d2t for the CPU kernel's markov_tree / markov_chain, or None where it does not
    apply (no kernel, or logprobs not float32 on the CPU)."""
    if kernel is None or logprobs.device.type != "cpu" or logprobs.dtype != torch.float32:
        return None
    tables = drafter.markov.host_tensors(drafter.target.embed, drafter.cfg.model.vocab_size)
    return (*tables, drafter.d2t if drafter.cfg.reduced_vocab else None)


def head_tree_nodes(drafter, logprobs: torch.Tensor, root: torch.Tensor, budget: int, kernel=None):
    """tree.best_first_nodes for a drafter with a Markov head: block log-probs [D, V] under root [1], each
    node's children from its own conditional, among max(8, budget) candidates per position (at most M). Returns
    parents, depths (numpy), draft ids (a LongTensor on the logprobs' device) and path log-probs; in one call of
    `kernel` (the CPU runtime's, kernels/tree.cpp) where given, with the same nodes."""
    m = candidate_count(drafter.markov, max(SMALL_TREE_CANDIDATES, budget), logprobs.shape[1])
    if (args := _kernel_args(drafter, logprobs, kernel)) is not None:
        parents, depths, ids, scores = kernel.markov_tree(logprobs.contiguous(), int(root), budget, m, *args)
        return parents.numpy(), depths.numpy(), ids, scores.numpy()
    parents, depths, tokens, scores = conditional_best_first(*conditional_table(drafter, logprobs, int(root), m), budget)
    return parents, depths, torch.tensor(tokens, dtype=torch.long, device=logprobs.device), scores


def head_chain_ids(drafter, logits: torch.Tensor, root: torch.Tensor, kernel=None) -> torch.Tensor:
    """The linear draft of a drafter with a Markov head: draft ids [D] (on the logits' device), each the best
    token given the one drafted before it (through `kernel` where given)."""
    logprobs = logits.float().log_softmax(dim=-1)
    m = candidate_count(drafter.markov, SMALL_TREE_CANDIDATES, logprobs.shape[1])
    if (args := _kernel_args(drafter, logprobs, kernel)) is not None:
        return kernel.markov_chain(logprobs.contiguous(), int(root), m, *args).to(logits.device)
    cand_ids, cond = conditional_table(drafter, logprobs, int(root), m)
    return torch.tensor(conditional_chain(cand_ids, cond), dtype=torch.long, device=logits.device)
