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
(tau moved by -1.1% to +0.6% at budgets 2 and 4 when that was measured). With a Markov head every root's trees
are the engine's own (markov.head_tree_nodes); tree_tau over cached tables (markov-fit's held-out figures) builds
them from fp16 log-probs over the tables' candidates instead, near but not always equal.

    python -m ddtree train probe --data data/smollm2-v5 --split heldout --budgets 1,2,4,8,32
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.markov import (SMALL_TREE_CANDIDATES, MarkovHead, candidate_count, conditional_best_first,
                      conditional_logprobs, head_tree_nodes)
from ..engine.tree import best_first_nodes
from ..models.protocol import reference
from .model import block_inputs, draft_head, drafter_block_hidden, target_features, target_to_draft


@dataclass
class AnchorDrafts:
    """Per position a (root = token a) of one answer: the drafter's top-k log-probs per block depth and the rank
    of the true token among them."""
    logprobs: np.ndarray  # [A, B-1, k] float32, descending along k
    ranks: np.ndarray  # [A, B-1] int64: rank of tokens[a+d] at depth d; k when outside the top-k (or no token)


@dataclass
class BlockDrafts:
    """Every root of one answer drafted as a whole block: roots from the first answer token (the prefill's own) to
    the second-to-last token, where decoding's roots lie (row i is the root at position prompt_len + i)."""
    anchors: torch.Tensor  # [A] root positions
    logprobs: torch.Tensor  # [A, B-1, draft vocab] float32: the drafter's log-probs at block positions 1..B-1
    labels: torch.Tensor  # [A, B-1] the true tokens as draft ids; -1 past the end or outside the draft vocabulary


@torch.inference_mode()
def block_drafts(target, drafter, tokens: list[int], prompt_len: int) -> BlockDrafts:
    cfg, drafter = drafter.cfg, reference(drafter)
    ids = torch.tensor(tokens, device=target.device)
    feats = target_features(target, ids, cfg.target_layer_ids).to(drafter.fc.weight.dtype)
    anchors = torch.arange(max(1, prompt_len), ids.numel() - 1, device=ids.device)
    block, positions, labels = block_inputs(ids, anchors, cfg.block_size, cfg.mask_token_id)
    hidden = drafter_block_hidden(drafter, feats, block, positions, anchors, reference(target).model.embed_tokens)
    head = draft_head(drafter, target)
    logprobs = (hidden[:, 1:] @ head.to(hidden.dtype).T).float().log_softmax(dim=-1)  # [A, B-1, draft vocab]
    labels = labels.clamp(min=-1)
    t2d = target_to_draft(drafter)
    if t2d is not None:  # the true tokens as draft ids: -1 outside the draft vocabulary
        labels = torch.where(labels >= 0, t2d[labels.clamp(min=0)], labels)
    return BlockDrafts(anchors, logprobs, labels)


def anchor_drafts(target, drafter, tokens: list[int], prompt_len: int, k: int = 32) -> AnchorDrafts:
    drafts = block_drafts(target, drafter, tokens, prompt_len)
    labels = drafts.labels
    top = drafts.logprobs.topk(min(k, drafts.logprobs.shape[-1]), dim=-1)
    hit = (top.indices == labels[..., None]) & (labels[..., None] >= 0)  # [A, B-1, k]
    ranks = torch.where(hit.any(-1), hit.int().argmax(-1), top.indices.shape[-1])
    return AnchorDrafts(top.values.cpu().numpy(), ranks.cpu().numpy().astype(np.int64))


def anchor_tables(drafts, tokens: list[int], m: int) -> dict[str, np.ndarray]:
    """One answer's rows (see the module doc) from probe.block_drafts' output."""
    lp = drafts.logprobs  # [A, D, V]
    cand_lp, cand_ids = lp.topk(min(m, lp.shape[-1]), dim=-1)  # [A, D, M]
    labels = drafts.labels  # [A, D]
    label_lp = lp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ids = torch.tensor(tokens, device=labels.device)
    d = labels.shape[1]
    parents = ids[(drafts.anchors[:, None] + torch.arange(d, device=ids.device)).clamp(max=ids.numel() - 1)]
    return {"cand_lp": cand_lp.half().cpu().numpy(), "cand_ids": cand_ids.int().cpu().numpy(),
            "labels": labels.int().cpu().numpy(), "label_lp": label_lp.float().cpu().numpy(),
            "parents": parents.int().cpu().numpy()}


@torch.no_grad()
def tree_tau(tables: dict[str, np.ndarray], budgets, head: MarkovHead | None = None, embed=None, to_target=None,
             batch: int = 128) -> dict[str, dict]:
    """The probe's T = 0 acceptance over every table root: per group (and "all") positions, top-1 (the spine's
    first token) and tau per budget of best-first trees; with a head, each node's children from its own
    conditional (markov.conditional_best_first), else the drafter's marginals (the engine's plain tree over the
    same top-M candidates). to_target: draft ids -> target ids (the parents' embeddings)."""
    return _averages(tree_tau_sums(tables, budgets, head, embed, to_target, batch), budgets)


def _averages(sums: dict[str, np.ndarray], budgets) -> dict[str, dict]:
    return {g: {"positions": int(v[0]), "top1": v[1] / v[0], "tau": {b: 1 + v[2 + i] / v[0]
                                                                     for i, b in enumerate(budgets)}}
            for g, v in sums.items()}


@torch.no_grad()
def tree_tau_sums(tables, budgets, head=None, embed=None, to_target=None, batch: int = 128,
                  sums: dict | None = None) -> dict[str, np.ndarray]:
    """tree_tau's sums per group: [positions, top-1 hits, accepted tokens per budget], added into `sums`."""
    budgets = tuple(budgets)
    a, d, m = tables["cand_ids"].shape
    sums = {} if sums is None else sums
    codes = head.code(embed).float() if head is not None else None  # [V, r]: every parent's code
    for s in range(0, a, batch):
        cand_lp = torch.from_numpy(tables["cand_lp"][s:s + batch].astype(np.float32))  # [b, D, M]
        cand_ids = torch.from_numpy(tables["cand_ids"][s:s + batch].astype(np.int64))
        if head is None:
            cond = cand_lp[:, :, None, :].expand(-1, -1, m, -1)
        else:
            parents = torch.empty_like(cand_ids)  # [b, D, M]: depth 0's parent is the root, then the candidates
            parents[:, 0] = torch.from_numpy(tables["parents"][s:s + batch, :1].astype(np.int64))
            parents[:, 1:] = to_target(cand_ids[:, :-1])
            cond, _ = conditional_logprobs(head, cand_lp, cand_ids, codes[parents], torch.arange(d))
        cond, ids = cond.float().numpy(), cand_ids.numpy()
        for i in range(cond.shape[0]):
            labels = tables["labels"][s + i]
            parents_, _, tokens, _ = conditional_best_first(ids[i], cond[i], max(budgets))
            path = _true_path(parents_, tokens, labels)
            row = np.array([1, bool(path) and path[0] == 1, *(sum(j <= b for j in path) for b in budgets)],
                           dtype=np.float64)
            for g in (str(tables["group"][s + i]), "all"):
                sums[g] = sums.get(g, 0) + row
    return sums


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


def head_accepted_lengths(drafter, logprobs: torch.Tensor, root: int, labels: np.ndarray, budgets) -> list[int]:
    """One position with a Markov head: the draft tokens accepted by the engine's own tree of each budget
    (markov.head_tree_nodes: its candidate count per budget, its double arithmetic), given the block's log-probs
    [D, V], the root's target id and the true tokens as draft ids [D] (-1: none). Budgets that draw on the same
    candidates share one tree: its pop order is a prefix per budget."""
    out = {}
    by_m: dict[int, list[int]] = {}  # candidates per position -> the budgets drawing on that many
    for b in budgets:
        m = candidate_count(drafter.markov, max(SMALL_TREE_CANDIDATES, b), logprobs.shape[-1])
        by_m.setdefault(m, []).append(b)
    for group in by_m.values():
        parents, _, ids, _ = head_tree_nodes(drafter, logprobs, torch.tensor(root), max(group))
        path = _true_path(parents, ids.tolist(), labels)
        out.update({b: sum(j <= b for j in path) for b in group})
    return [out[b] for b in budgets]


def _true_path(parents: np.ndarray, tokens: list[int], labels: np.ndarray) -> list[int]:
    """The nodes (1-based, pop order) on the true continuation labels [D], while the tree holds it."""
    children = {(int(p), t): j + 1 for j, (p, t) in enumerate(zip(parents[1:].tolist(), tokens))}
    path, node = [], 0
    for lab in labels.tolist():
        node = children.get((node, lab), -1) if lab >= 0 else -1
        if node < 0:
            break
        path.append(node)
    return path


SIBLING_RANKS = 4  # a "sibling" parent: the true token ranked 2nd-4th at its depth (a small tree holds it)


def path_hits(ranks: np.ndarray) -> np.ndarray:
    """Where a block draft's marginals fail a tree: ranks [A, D] (the true token's rank at each depth; >= k outside
    the top-k) -> counts [D-1, 2, 3]. For depth d = 2..D over the roots whose true path ranked < SIBLING_RANKS at every
    depth before d, split by the parent's rank (0: the spine, top-1; 1..SIBLING_RANKS-1: a sibling): [roots, the true
    token top-1 at d, the true token in the top SIBLING_RANKS at d]. A block pass drafts depth d without knowing
    which token stood at d-1, so after a sibling its marginal mostly continues the spine's top-1."""
    a, d = ranks.shape
    out = np.zeros((max(d - 1, 0), 2, 3), dtype=np.int64)
    reach = ranks[:, 0] < SIBLING_RANKS  # [A]: the true path so far lies in the top SIBLING_RANKS at every depth
    for depth in range(1, d):
        for kind, parent in enumerate((ranks[:, depth - 1] == 0, ranks[:, depth - 1] > 0)):
            rows = reach & parent
            out[depth - 1, kind] = (rows.sum(), (rows & (ranks[:, depth] == 0)).sum(),
                                    (rows & (ranks[:, depth] < SIBLING_RANKS)).sum())
        reach &= ranks[:, depth] < SIBLING_RANKS
    return out


def path_hit_rates(counts: np.ndarray) -> list[dict]:
    """path_hits' counts -> per depth (2..D) {"depth", "spine"/"sibling": {"roots", "top1", "topk"}} (rates)."""
    def rates(c):
        return {"roots": int(c[0]), "top1": c[1] / c[0] if c[0] else None, "topk": c[2] / c[0] if c[0] else None}
    return [{"depth": i + 2, "spine": rates(c[0]), "sibling": rates(c[1])} for i, c in enumerate(counts)]


def probe(target, drafter, sequences, budgets=(1, 2, 4, 8, 32), k: int = 32, progress=None) -> dict:
    """sequences: (tokens, prompt_len, group) triples. Returns per group (and "all"): positions, top1 (the
    first block position's), tau per budget, and (from the marginals, without a head) "paths": path_hit_rates. With a
    Markov head every tree is the engine's (head_accepted_lengths)."""
    budgets = tuple(budgets)
    sums: dict[str, np.ndarray] = {}
    hits: dict[str, np.ndarray] = {}
    for tokens, prompt_len, group in sequences:
        if drafter.markov is not None:
            drafts = block_drafts(target, drafter, tokens, prompt_len)
            labels, roots = drafts.labels.cpu().numpy(), np.asarray(tokens)[drafts.anchors.cpu().numpy()]
            rows = [(lab[0] >= 0 and int(drafts.logprobs[i, 0].argmax()) == lab[0],
                     head_accepted_lengths(drafter, drafts.logprobs[i], int(roots[i]), lab, budgets))
                    for i, lab in enumerate(labels)]
        else:
            drafts = anchor_drafts(target, drafter, tokens, prompt_len, k)
            rows = [(rk[0] == 0, accepted_lengths(lp, rk, budgets)) for lp, rk in zip(drafts.logprobs, drafts.ranks)]
            counts = path_hits(drafts.ranks)
            for g in (group, "all"):
                hits[g] = hits.get(g, 0) + counts
        for top1, accepted in rows:
            row = np.array([1, top1, *accepted], dtype=np.float64)
            for g in (group, "all"):
                sums[g] = sums.get(g, 0) + row
        if progress is not None:
            progress()
    out = _averages(sums, budgets)
    for g, counts in hits.items():
        out[g]["paths"] = path_hit_rates(counts)
    return out
