"""Draft trees as pure functions: build (best-first heap), compile (ancestor mask), walk (accept).

A tree has N nodes in "tree order": node 0 is the root (the bonus token the target committed last), every
parent precedes its children, and node i sits at position start + depth[i]. A chain (linear DFlash) and a
lone root (plain decoding) are trees too, so one verify/walk/commit path serves all three methods.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long, where the step operations keep it (the model's device, or the host); tokens[0] = root
    parents: np.ndarray  # [N] int64, parents[0] = -1
    depths: np.ndarray  # [N] int64, depths[0] = 0
    # what the drafter said, for traces: its logits [depth, draft vocab] for block positions 1..depth, and the
    # draft-vocabulary ids [N - 1] of nodes 1..N-1 (= tokens[1:] unless the drafter has a reduced vocabulary)
    draft_logits: torch.Tensor | None = None
    draft_ids: torch.Tensor | None = None
    grafted: int = 0  # the last `grafted` nodes came from a context lookup (lookup.py), not from the drafter

    @property
    def size(self) -> int:
        return len(self.parents)


class Popped(NamedTuple):
    """A step's best-first nodes before the budget cuts them (pop order, root first: any prefix is a tree) and the
    lookup chain that will be grafted on what is kept ([] without one)."""
    parents: np.ndarray  # [n + 1] int64
    depths: np.ndarray  # [n + 1] int64
    tokens: torch.Tensor  # [n + 1] long, target vocabulary
    chain: list[int]


def chain_parents(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Parents and depths of a chain of n nodes (root included)."""
    return np.arange(-1, n - 1, dtype=np.int64), np.arange(n, dtype=np.int64)


# A top-k over the whole vocabulary is the dominant cost of a build on a CPU and grows with k, while a best-first tree rarely reads deep ranks at most
# depths. So every depth first gets its top FIRST_RANKS; a depth the heap reads past them is fetched again with
# the full top-k (one row, once). The heap sees exactly the ranks a full top-k would give.
FIRST_RANKS = 32


class _Ranks:
    """Per depth: token ids and log-probs in descending order (lists), exact for every rank < k."""

    def __init__(self, logprobs: torch.Tensor, k: int):
        self.logprobs, self.k = logprobs, k
        vals, ids = logprobs.topk(min(k, FIRST_RANKS), dim=-1)
        self.lp, self.ids = vals.tolist(), ids.tolist()
        self.complete = [k <= FIRST_RANKS] * logprobs.shape[0]

    def has(self, d: int, r: int) -> bool:
        """Whether depth d has a rank r < k, fetching the rest of the row's top-k when r is past the first ranks."""
        if r < len(self.lp[d]):
            return True
        if self.complete[d] or r >= self.k:
            return False
        vals, ids = self.logprobs[d].topk(self.k)
        seen = set(self.ids[d])  # keep the ranks already handed out: with ties (bf16 logits) the order may differ
        extra = [(v, t) for v, t in zip(vals.tolist(), ids.tolist()) if t not in seen][: self.k - len(seen)]
        self.lp[d] += [v for v, _ in extra]
        self.ids[d] += [t for _, t in extra]
        self.complete[d] = True
        return r < len(self.lp[d])


def graft_chain(tokens: list[int], parents: list[int], depths: list[int], chain: list[int]) -> int:
    """Add the path root -> chain[0] -> chain[1] ... to a tree given as lists (tree order; changed in place): where a
    node's child already holds the chain's next token the path goes on through it, the rest of the chain is appended
    as new nodes, each the child of the one before. Returns how many nodes were appended (0: the tree held it)."""
    node, added = 0, 0
    for token in chain:
        child = next((i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if child is None:
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node] + 1)
            child, added = len(tokens) - 1, added + 1
        node = child
    return added


def chain_added(parents, depths, tokens, chain: list[int]) -> list[int]:
    """For b = 0, 1, ..., n: how many nodes graft_chain(chain) would append to the tree of the root and the first b
    nodes of a pop order (parents, depths, tokens [n + 1] as lists, root first; any prefix is a tree). The chain
    shares the path of nodes that hold its tokens from the root down; each later chain token is a new node."""
    on_chain = [True] + [False] * (len(parents) - 1)  # node i holds chain[:depth i]'s last token on its path
    added, out = len(chain), [len(chain)]
    for i in range(1, len(parents)):
        d = depths[i]
        if d <= len(chain) and on_chain[parents[i]] and tokens[i] == chain[d - 1]:
            on_chain[i], added = True, added - 1
        out.append(added)
    return out


def best_first_nodes(logprobs: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
    """Pick the `budget` draft paths with the highest probability under the drafter's per-position factorization.

    logprobs: [depth, V] log-probabilities for block positions 1..depth. A node is a path of ranks (one per
    depth) scored by the sum of its ranks' log-probs. Popping the best node and pushing its next-rank sibling
    and its rank-0 child visits nodes in non-increasing score order; since a child never outscores its parent,
    the first `budget` pops form a tree that maximizes the summed node probability (expected accepted length).
    Returns parents [budget + 1], depths [budget + 1] (root included), the budget nodes' token ids and each draft
    node's path log-probability [budget], in pop order (non-increasing).
    Any prefix of the pop order is itself a tree: the first b nodes are the best tree of budget b.
    kernels/tree.cpp's best_first_tree is the same heap in C++ (the engine's on a CPU runtime); equal log-probs
    within a depth are ordered there by token id, here as torch.topk returns them."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    max_depth, vocab = logprobs.shape
    return _best_first(_Ranks(logprobs.float(), min(budget, vocab)), max_depth, budget)


def best_first_topk(top_logprobs: list[list[float]], top_ids: list[list[int]], budget: int) -> tuple:
    """best_first_nodes from each depth's whole top-k, already on the host: log-probs [depth][k] in descending order
    and their token ids [depth][k], k = min(budget, vocab) (what one top-k and one copy back give)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    return _best_first(_TopK(top_logprobs, top_ids), len(top_logprobs), budget)


class _TopK:
    """_Ranks over a complete top-k given as lists."""

    def __init__(self, lp: list[list[float]], ids: list[list[int]]):
        self.lp, self.ids = lp, ids

    def has(self, d: int, r: int) -> bool:
        return r < len(self.lp[d])


def _best_first(ranks, max_depth: int, budget: int) -> tuple:
    """The heap of best_first_nodes over `ranks` (a _Ranks or a _TopK)."""
    lp, ids = ranks.lp, ranks.ids  # lists that ranks.has() extends in place
    parents, depths, tokens, scores = [-1], [0], [], []
    # heap entries: (-score, parent node, depth index d (block position d + 1), rank r)
    heap = [(-lp[0][0], 0, 0, 0)]
    while heap and len(tokens) < budget:
        neg, parent, d, r = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        depths.append(d + 1)
        tokens.append(ids[d][r])
        scores.append(-neg)
        if ranks.has(d, r + 1):  # next sibling: same parent, next rank at this depth
            heapq.heappush(heap, (neg + lp[d][r] - lp[d][r + 1], parent, d, r + 1))
        if d + 1 < max_depth:  # first child: best rank one level deeper
            heapq.heappush(heap, (neg - lp[d + 1][0], node, d + 1, 0))
    return (np.asarray(parents, dtype=np.int64), np.asarray(depths, dtype=np.int64), tokens,
            np.asarray(scores, dtype=np.float64))


def ancestor_matrix(parents: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """bool [N, N]: [i, j] = node j is an ancestor-or-self of node i (the tree-attention visibility)."""
    n = len(parents)
    rows = np.arange(n)
    anc = np.zeros((n, n), dtype=bool)
    anc[rows, rows] = True
    cur = rows.copy()
    up = np.where(parents < 0, rows, parents)  # the root is its own parent, so hops saturate there
    for _ in range(int(depths.max(initial=0))):
        cur = up[cur]
        anc[rows, cur] = True
    return anc


def walk(tree: DraftTree, ancestors: torch.Tensor | None, choices: torch.Tensor) -> tuple[list[int], list[int]]:
    """Accept the longest root path on which every node's token is the target's choice at its parent.

    choices [N]: the target's token at each node (argmax, or a sample of its distribution given that node's
    prefix). Returns the accepted path (node indices, root first) and all N choices on the host. The tokens
    to emit are choices[path]: the choice at each path node is the next node's token (an accepted draft),
    and the choice at the path's end is the bonus token. One device->host transfer.
    """
    if tree.size == 1:
        return [0], choices.tolist()
    if choices.device.type == "cpu":  # on the host already: one pass in tree order beats ~12 small tensor ops
        return _walk_host(tree.parents.tolist(), tree.tokens.tolist(), choices.tolist())
    return _walk_device(tree, ancestors, choices)


def _walk_device(tree: DraftTree, ancestors: torch.Tensor, choices: torch.Tensor) -> tuple[list[int], list[int]]:
    """walk() as tensor ops on the choices' device, then one transfer."""
    parents = torch.from_numpy(tree.parents).to(choices.device)
    depths = torch.from_numpy(tree.depths).to(choices.device)
    match = tree.tokens == choices[parents.clamp(min=0)]  # [N] node's token is its parent's choice
    match[0] = True
    ok = ~(ancestors & ~match[None, :]).any(dim=1)  # [N] the whole root path matches
    end = torch.where(ok, depths, -1).argmax()
    host = torch.cat([end.view(1), choices]).tolist()
    path = [host[0]]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1], host[1:]


def _walk_host(parents: list[int], tokens: list[int], choices: list[int]) -> tuple[list[int], list[int]]:
    """walk() on host lists: a node is on an accepted path when its parent is and its token is the parent's choice
    (parents precede children); the path ends at the first deepest such node, as walk()'s argmax picks."""
    ok, depth = [True] + [False] * (len(parents) - 1), [0] * len(parents)
    end = 0
    for i in range(1, len(parents)):
        p = parents[i]
        if ok[p] and tokens[i] == choices[p]:
            ok[i], depth[i] = True, depth[p] + 1
            if depth[i] > depth[end]:
                end = i
    path = [end]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1], choices


def walk_drawn(tree: DraftTree, draw) -> tuple[list[int], list[int]]:
    """The walk at T > 0, drawing the target's token only where the walk looks: draw(i) samples node i's
    choice (an int). Start at the root; while a child carries the drawn token, move there and draw again.
    Each choice is an independent draw from that node's distribution, exactly as when every node is drawn up
    front (the walk never reads the others), at the cost of at most depth + 1 draws instead of N.
    Returns the path (root first) and choices [N] with -1 at nodes never visited."""
    tokens = tree.tokens.tolist()
    children: dict[tuple[int, int], int] = {(p, tokens[i]): i for i, p in enumerate(tree.parents.tolist()) if p >= 0}
    choices = [-1] * tree.size
    path = [0]
    while True:
        node = path[-1]
        choices[node] = draw(node)
        child = children.get((node, choices[node]))
        if child is None:
            return path, choices
        path.append(child)

