"""Per-step tree traces: what the drafter proposed, what the target chose, what was accepted.

One record per decoding step (JSON-ready):

    tokens          [N] node tokens in tree order (node 0 = the root, the last committed token)
    parents         [N] parent node (-1 for the root); depths [N] (root 0)
    draft_logprobs  [N] the drafter's log-probability of each node's token at its block position (root 0.0; -inf
                    for a node grafted from a context lookup, which the drafter did not propose)
    grafted         how many nodes, the last ones, a context lookup grafted onto the drafter's tree (lookup.py)
    choices         [N] the target's token at each node (greedy: all nodes; sampled, or greedy with a
                    float32 CPU target's per-row logits (target.RowLogits): -1 where the walk did not look)
    accepted        the accepted path's node indices, root first (its last node's choice is the bonus token)

`acceptance_by_depth`, `acceptance_by_rank` and `calibration` reduce a list of records to what
plot_results.py draws: how deep trees get accepted, how often the drafter's k-th choice is the right one, and
whether a path the drafter gives probability p is accepted a fraction p of the time.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch

from .tree import DraftTree


def step_record(tree: DraftTree, choices: list[int], path: list[int]) -> dict:
    """The trace of one step (computes the draft log-probs only here, so untraced steps never pay for them)."""
    tokens = tree.tokens.tolist()
    drafted = tree.size - tree.grafted  # the root and the drafter's nodes come first
    logprobs = [0.0] * drafted + [-math.inf] * tree.grafted
    if tree.draft_logits is not None and drafted > 1:
        lp = tree.draft_logits.float().log_softmax(dim=-1)  # [depth, draft vocab]
        at = torch.from_numpy(tree.depths[1:drafted] - 1).to(lp.device)  # node i sits at block position depths[i]
        ids = tree.tokens[1:drafted] if tree.draft_ids is None else tree.draft_ids
        logprobs[1:drafted] = lp[at, ids.to(lp.device)].tolist()
    return dict(tokens=tokens, parents=tree.parents.tolist(), depths=tree.depths.tolist(),
                draft_logprobs=logprobs, choices=list(choices), accepted=list(path), grafted=tree.grafted)


def _tested(rec: dict) -> list[tuple[int, bool]]:
    """(node, accepted) for every draft node whose parent is on the accepted path: the nodes the walk judged."""
    on_path = set(rec["accepted"])
    return [(i, i in on_path) for i in range(1, len(rec["parents"])) if rec["parents"][i] in on_path]


def acceptance_by_depth(records: list[dict]) -> dict[int, tuple[float, float, int]]:
    """depth d -> (P(accepted path reaches d), P(reaches d | reached d - 1), steps whose tree reaches depth d)."""
    reached, tried, cond = defaultdict(int), defaultdict(int), defaultdict(int)
    for rec in records:
        depth = max(rec["depths"], default=0)
        got = len(rec["accepted"]) - 1
        for d in range(1, depth + 1):
            tried[d] += 1
            reached[d] += got >= d
            cond[d] += got >= d - 1
    return {d: (reached[d] / tried[d], reached[d] / max(1, cond[d]), tried[d]) for d in sorted(tried)}


def sibling_ranks(rec: dict) -> list[int]:
    """Each node's rank among its siblings by draft log-prob (0 = the drafter's first choice; root: 0)."""
    groups = defaultdict(list)
    for i in range(1, len(rec["parents"])):
        groups[rec["parents"][i]].append(i)
    ranks = [0] * len(rec["parents"])
    for children in groups.values():
        for r, i in enumerate(sorted(children, key=lambda i: -rec["draft_logprobs"][i])):
            ranks[i] = r
    return ranks


def acceptance_by_rank(records: list[dict]) -> dict[int, tuple[float, int]]:
    """sibling rank r -> (fraction of judged rank-r nodes accepted, how many were judged)."""
    hits, total = defaultdict(int), defaultdict(int)
    for rec in records:
        ranks = sibling_ranks(rec)
        for node, ok in _tested(rec):
            total[ranks[node]] += 1
            hits[ranks[node]] += ok
    return {r: (hits[r] / total[r], total[r]) for r in sorted(total)}


def path_logprobs(rec: dict) -> list[float]:
    """Each node's whole-path draft log-probability (the sum of its ancestors' token log-probs)."""
    out = [0.0] * len(rec["parents"])
    for i in range(1, len(out)):  # parents precede children
        out[i] = out[rec["parents"][i]] + rec["draft_logprobs"][i]
    return out


def calibration(records: list[dict], bins: int = 10) -> dict:
    """Reliability of the drafter's path probabilities and the accepted path's probability by its length.

    reliability: per probability bin, (mean predicted path probability, fraction of those nodes on the
    accepted path, count), over every draft node: a calibrated drafter lies on the diagonal.
    by_length: accepted draft tokens L -> (mean draft probability of the accepted path, steps)."""
    pred, hit = [], []
    by_length = defaultdict(list)
    for rec in records:
        paths = path_logprobs(rec)
        on_path = set(rec["accepted"])
        for i in range(1, len(paths)):
            pred.append(math.exp(paths[i]))
            hit.append(i in on_path)
        by_length[len(rec["accepted"]) - 1].append(math.exp(paths[rec["accepted"][-1]]))
    reliability = []
    if pred:
        pred_a, hit_a = np.asarray(pred), np.asarray(hit, dtype=np.float64)
        which = np.minimum((pred_a * bins).astype(int), bins - 1)
        for b in range(bins):
            sel = which == b
            if sel.any():
                reliability.append((float(pred_a[sel].mean()), float(hit_a[sel].mean()), int(sel.sum())))
    return dict(reliability=reliability,
                by_length={k: (float(np.mean(v)), len(v)) for k, v in sorted(by_length.items())})
