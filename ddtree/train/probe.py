"""Offline acceptance probe: what a drafter would accept at EVERY position of the target's own greedy answers.

At T = 0 the target's continuation after a position is fixed whatever tree is verified there, so the accepted
length of any tree rooted at position a is the depth of its deepest node on the true continuation
tokens[a+1 .. a+B-1]. One target pass over an answer gives every position's tap features, and one drafter
training-forward pass (`model.drafter_block_hidden`, equal to add_context + draft) gives every position's
block. So a probe measures top-1 and the tree acceptance of many budgets over all positions of many answers in
one pass each, with no decoding. tau here = 1 + the mean accepted length over positions (a decoding run visits
only the positions it lands on; `tests/test_probe.py` checks that on those it accepts exactly what the engine
accepts). Every tree is built from a draft of the whole block, as the engine's `dflash` and `ddtree` from budget
7 on draft; below that `ddtree` drafts budget + 1 positions (engine.DDTree), whose distributions differ slightly
(tau moved by -1.1% to +0.6% at budgets 2 and 4 when that was measured).

    python -m ddtree train probe --data data/smollm2-v5 --split heldout --budgets 1,2,4,8,32
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..tree import best_first_nodes
from .model import block_inputs, draft_head, drafter_block_hidden, target_features, target_to_draft


@dataclass
class AnchorDrafts:
    """Per position a (root = token a) of one answer: the drafter's top-k log-probs per block depth and the rank
    of the true token among them."""
    logprobs: np.ndarray  # [A, B-1, k] float32, descending along k
    ranks: np.ndarray  # [A, B-1] int64: rank of tokens[a+d] at depth d; k when outside the top-k (or no token)


@torch.inference_mode()
def anchor_drafts(target, drafter, tokens: list[int], prompt_len: int, k: int = 32) -> AnchorDrafts:
    """Roots from the first answer token (the prefill's own) to the second-to-last token, where decoding's roots
    lie; row i is the root at position prompt_len + i."""
    cfg = drafter.cfg
    ids = torch.tensor(tokens, device=target.device)
    feats = target_features(target, ids, cfg.target_layer_ids).to(drafter.fc.weight.dtype)
    anchors = torch.arange(max(1, prompt_len), ids.numel() - 1, device=ids.device)
    block, positions, labels = block_inputs(ids, anchors, cfg.block_size, cfg.mask_token_id)
    hidden = drafter_block_hidden(drafter, feats, block, positions, anchors, target.model.embed_tokens)
    head = draft_head(drafter, target)
    logprobs = (hidden[:, 1:] @ head.to(hidden.dtype).T).float().log_softmax(dim=-1)  # [A, B-1, draft vocab]
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    t2d = target_to_draft(drafter)
    if t2d is not None:  # the true tokens as draft ids: -1 outside the draft vocabulary
        labels = torch.where(labels >= 0, t2d[labels.clamp(min=0)], labels)
    hit = (top.indices == labels[..., None]) & (labels[..., None] >= 0)  # [A, B-1, k]
    ranks = torch.where(hit.any(-1), hit.int().argmax(-1), top.indices.shape[-1])
    return AnchorDrafts(top.values.cpu().numpy(), ranks.cpu().numpy().astype(np.int64))


def accepted_lengths(logprobs: np.ndarray, ranks: np.ndarray, budgets) -> list[int]:
    """One position: the draft tokens accepted by the best-first tree of each budget (the engine's own build over
    the top-k ranks, which carry the same scores), given the true ranks [B-1]."""
    index = {path: i for i, path in enumerate(_rank_paths(logprobs, max(budgets)))}
    order, path = [], ()
    for r in ranks.tolist():  # the true continuation's node at each depth, while the tree has it
        path = path + (r,)
        if path not in index:
            break
        order.append(index[path])
    return [sum(i < b for i in order) for b in budgets]  # a parent pops before its children: a prefix per budget


def _rank_paths(logprobs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """best_first_nodes over a [depth, k] rank table: each drafted node, in pop order, named by its path of ranks."""
    parents, _, tokens, _ = best_first_nodes(torch.from_numpy(np.ascontiguousarray(logprobs)), budget)
    paths = [()]
    for p, t in zip(parents[1:].tolist(), tokens):
        paths.append(paths[p] + (t,))
    return paths[1:]


def probe(target, drafter, sequences, budgets=(1, 2, 4, 8, 32), k: int = 32, progress=None) -> dict:
    """sequences: (tokens, prompt_len, group) triples. Returns per group (and "all"): positions, top1 (the
    first block position's), tau per budget."""
    budgets = tuple(budgets)
    sums: dict[str, np.ndarray] = {}
    for tokens, prompt_len, group in sequences:
        drafts = anchor_drafts(target, drafter, tokens, prompt_len, k)
        for lp, rk in zip(drafts.logprobs, drafts.ranks):
            row = np.array([1, rk[0] == 0, *accepted_lengths(lp, rk, budgets)], dtype=np.float64)
            for g in (group, "all"):
                sums[g] = sums.get(g, 0) + row
        if progress is not None:
            progress()
    return {g: {"positions": int(s[0]), "top1": s[1] / s[0], "tau": {b: 1 + s[2 + i] / s[0] for i, b in
                                                                      enumerate(budgets)}}
            for g, s in sums.items()}
