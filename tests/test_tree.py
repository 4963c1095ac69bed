"""Tree building, compiling and walking: pure functions checked against brute force."""
import itertools

import numpy as np
import pytest
import torch

from ddtree.engine.tree import DraftTree, ancestor_matrix, best_first_nodes, chain_parents, walk


def brute_force_best(logprobs: torch.Tensor, budget: int) -> float:
    """The largest total probability of any `budget` prefix-closed paths (a valid tree), by enumeration."""
    depth, vocab = logprobs.shape
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]
    prob = {p: float(sum(logprobs[i, t] for i, t in enumerate(p)).exp()) for p in paths}
    # The best prefix-closed set is the `budget` most probable paths: a child never outscores its parent,
    # so taking the top-`budget` (parents break ties first) is always prefix-closed.
    ranked = sorted(paths, key=lambda p: (-prob[p], len(p)))
    return sum(prob[p] for p in ranked[:budget])


def tree_paths(parents, tokens):
    paths = {0: ()}
    for i in range(1, len(parents)):
        paths[i] = paths[int(parents[i])] + (tokens[i - 1],)
    return paths


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget", [1, 2, 5, 9, 20])
def test_heap_tree_is_optimal(seed, budget):
    gen = torch.Generator().manual_seed(seed)
    depth, vocab = 3, 4
    logprobs = (torch.randn(depth, vocab, generator=gen) * 2).log_softmax(-1)
    parents, depths, tokens, _ = best_first_nodes(logprobs, budget)
    n = min(budget, sum(vocab ** d for d in range(1, depth + 1)))
    assert len(tokens) == n and len(parents) == n + 1 and len(depths) == n + 1
    assert all(parents[i] < i for i in range(1, n + 1)), "every parent precedes its children"
    assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, n + 1))
    paths = tree_paths(parents, tokens)
    assert len(set(paths.values())) == n + 1, "no duplicate paths"
    total = sum(float(sum(logprobs[i, t] for i, t in enumerate(p)).exp()) for p in list(paths.values())[1:])
    assert total == pytest.approx(brute_force_best(logprobs, budget), rel=1e-5)


def test_budget_larger_than_vocab_and_depth():
    logprobs = torch.randn(2, 3).log_softmax(-1)
    parents, depths, tokens, _ = best_first_nodes(logprobs, 100)
    assert len(tokens) == 3 + 9  # the whole tree of depth 2 over 3 tokens
    with pytest.raises(ValueError, match="budget"):
        best_first_nodes(logprobs, 0)


def test_ancestor_matrix_matches_parent_walks():
    rng = np.random.default_rng(0)
    for n in (1, 2, 17, 64):
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
        depths = np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        anc = ancestor_matrix(parents, depths)
        for i in range(n):
            expect, j = {i}, i
            while parents[j] >= 0:
                j = int(parents[j])
                expect.add(j)
            assert set(np.flatnonzero(anc[i])) == expect


def test_chain_is_lower_triangular():
    parents, depths = chain_parents(5)
    assert (ancestor_matrix(parents, depths) == np.tril(np.ones((5, 5), dtype=bool))).all()


def make_tree(parents, tokens):
    parents = np.array(parents)
    depths = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return DraftTree(torch.tensor(tokens), parents, depths), torch.from_numpy(ancestor_matrix(parents, depths))


def test_walk_follows_matching_children():
    #        0(root:5)
    #       /     \
    #     1(7)    2(8)
    #     |        |
    #     3(9)    4(3)
    tree, anc = make_tree([-1, 0, 0, 1, 2], [5, 7, 8, 9, 3])
    # target picks 8 at the root, 3 at node 2, then 6 at node 4: path 0-2-4, bonus 6
    choices = torch.tensor([8, 0, 3, 0, 6])
    path, ch = walk(tree, anc, choices)
    assert path == [0, 2, 4] and [ch[i] for i in path] == [8, 3, 6]
    # a mismatch at the root: nothing accepted, the root's choice is the bonus
    path, ch = walk(tree, anc, torch.tensor([1, 9, 3, 0, 0]))
    assert path == [0] and ch[0] == 1
    # a deeper node whose own token matches but whose parent did not is NOT accepted
    path, _ = walk(tree, anc, torch.tensor([7, 1, 3, 0, 0]))
    assert path == [0, 1]


def test_host_walk_equals_the_tensor_walk_on_random_trees():
    """walk() on CPU choices runs a host loop; on a GPU, tensor ops (_walk_device). Both must take the same path:
    random best-first-shaped trees, choices that match many nodes, duplicate tokens among siblings included."""
    from ddtree.engine.tree import _walk_device

    gen = torch.Generator().manual_seed(0)
    for n in (2, 3, 5, 9, 17, 40):
        for trial in range(25):
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
            depths = [0] * n
            for i in range(1, n):
                depths[i] = depths[parents[i]] + 1
            tokens = torch.randint(0, 3, (n,), generator=gen)
            tree = DraftTree(tokens, np.asarray(parents, dtype=np.int64), np.asarray(depths, dtype=np.int64))
            anc = torch.from_numpy(ancestor_matrix(tree.parents, tree.depths))
            choices = torch.randint(0, 3, (n,), generator=gen)
            assert walk(tree, anc, choices) == _walk_device(tree, anc, choices), (parents, tokens, choices)


def test_walk_single_node():
    tree = DraftTree(torch.tensor([4]), *chain_parents(1))
    assert walk(tree, None, torch.tensor([2])) == ([0], [2])


def full_topk_scores(logprobs: torch.Tensor, budget: int) -> list[float]:
    """Reference: the heap over a full top-k of every depth; returns the chosen paths' scores, sorted."""
    import heapq

    k = min(budget, logprobs.shape[1])
    lp = logprobs.float().topk(k, dim=-1).values.tolist()
    heap, scores = [(-lp[0][0], 0, 0)], []
    while heap and len(scores) < budget:
        neg, d, r = heapq.heappop(heap)
        scores.append(-neg)
        if r + 1 < k:
            heapq.heappush(heap, (neg + lp[d][r] - lp[d][r + 1], d, r + 1))
        if d + 1 < len(lp):
            heapq.heappush(heap, (neg - lp[d + 1][0], d + 1, 0))
    return sorted(scores, reverse=True)


@pytest.mark.parametrize("case", ["confident", "flat", "bf16-ties", "one-wide-depth"])
@pytest.mark.parametrize("budget", [1, 16, 64, 256, 1024])
def test_lazy_ranks_give_the_full_topk_tree(case, budget):
    """Reading only the first ranks of each depth (and the rest of a row when the heap gets there) picks trees
    as good as a full top-k over a 49K vocabulary: the same path scores, a valid tree, no duplicate paths."""
    from ddtree.engine.tree import FIRST_RANKS, best_first_nodes

    gen = torch.Generator().manual_seed(budget)
    depth, vocab = 15, 49152
    logits = torch.randn(depth, vocab, generator=gen)
    if case == "confident":  # a trained drafter: one likely token per depth, a long tail
        logits *= 2.5
        logits[torch.arange(depth), torch.randint(0, vocab, (depth,), generator=gen)] += 12
    elif case == "flat":  # an untrained drafter
        logits *= 0.3
    elif case == "bf16-ties":
        logits = (logits * 4).bfloat16()
    else:  # depth 0 falls 0.1 nat per rank: a big tree reads it far past FIRST_RANKS
        logits[0] = -50.0
        logits[0, :2000] = -0.1 * torch.arange(2000.0)
        logits[1:] *= 4
    lp = logits.float().log_softmax(-1)
    parents, depths, tokens, scores = best_first_nodes(lp, budget)
    assert len(tokens) == budget and all(parents[i] < i for i in range(1, budget + 1))
    assert list(scores) == pytest.approx(full_topk_scores(lp, budget), abs=1e-4)
    paths = tree_paths(parents, tokens)
    assert len(set(paths.values())) == budget + 1
    for i in range(1, budget + 1):  # each score is its path's log-prob
        assert scores[i - 1] == pytest.approx(sum(float(lp[j, t]) for j, t in enumerate(paths[i])), abs=1e-3)
    if case == "one-wide-depth" and budget >= 256:  # ranks past the first ones were read
        assert max(t for t, d in zip(tokens, depths[1:]) if d == 1) >= FIRST_RANKS


def test_lazy_ranks_refetch_keeps_the_ranks_already_used():
    from ddtree.engine.tree import FIRST_RANKS, _Ranks

    lp = torch.zeros(2, 1000)  # all tied: any order is a valid ranking, the refetch may order them differently
    ranks = _Ranks(lp, k=100)
    first = list(ranks.ids[0])
    assert len(first) == FIRST_RANKS and not ranks.complete[0]
    assert ranks.has(0, FIRST_RANKS) and ranks.complete[0] and ranks.ids[0][:FIRST_RANKS] == first
    assert len(ranks.ids[0]) == 100 == len(set(ranks.ids[0])) and not ranks.has(0, 100)
    assert len(ranks.ids[1]) == FIRST_RANKS  # a row the heap never read deeply is never fetched again


def test_walk_drawn_visits_only_the_path_and_agrees_with_walk():
    """At T > 0 the walk draws the target's choice only where it looks; given the same choices it takes the
    same path and emits the same tokens as the walk over all nodes."""
    from ddtree.engine.tree import walk_drawn

    tree, anc = make_tree([-1, 0, 0, 1, 2], [5, 7, 8, 9, 3])
    for choices in ([8, 0, 3, 0, 6], [1, 9, 3, 0, 0], [7, 1, 3, 0, 0], [7, 9, 0, 4, 0]):
        asked = []
        path, drawn = walk_drawn(tree, lambda i: asked.append(i) or choices[i])
        ref_path, ref_choices = walk(tree, anc, torch.tensor(choices))
        assert path == ref_path and asked == path  # one draw per visited node, in walk order
        assert [drawn[i] for i in path] == [ref_choices[i] for i in path]
        assert all(drawn[i] == -1 for i in range(tree.size) if i not in path)
    single = DraftTree(torch.tensor([4]), *chain_parents(1))
    assert walk_drawn(single, lambda i: 2) == ([0], [2])


# --- the same functions in the CPU kernel (kernels/tree.cpp), as the engine runs them on a CPU runtime -------------
def _kernel():
    from ddtree.runtime.cpu import qlinear

    return qlinear.kernel()


def _distinct_logprobs(gen: torch.Generator, depth: int, vocab: int, scale: float) -> torch.Tensor:
    """Random log-probs without ties inside a row (torch.topk leaves the order of equal values unspecified): each row
    the normal quantiles of its vocabulary in a random order, far more than a rounding apart."""
    quantiles = torch.special.ndtri((torch.arange(vocab, dtype=torch.float64) + 0.5) / vocab).float() * scale
    lp = torch.stack([quantiles[torch.randperm(vocab, generator=gen)] for _ in range(depth)]).log_softmax(-1)
    assert not (lp.sort(dim=-1).values.diff(dim=-1) == 0).any()
    return lp


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth,vocab,budget", [(1, 5, 3), (2, 8192, 2), (7, 8192, 8), (15, 8192, 16),
                                                (4, 300, 64), (3, 40, 100), (15, 2000, 256)])
def test_kernel_tree_is_the_python_heap(seed, depth, vocab, budget):
    """best_first_tree: the same parents, depths, ids and path log-probs (bit for bit) in the same pop order, lazy
    ranks past the first 32 included."""
    lp = _distinct_logprobs(torch.Generator().manual_seed(seed), depth, vocab, scale=[0.5, 2.0, 6.0][seed % 3])
    parents, depths, ids, scores = _kernel().best_first_tree(lp, budget)
    want = best_first_nodes(lp, budget)
    np.testing.assert_array_equal(parents.numpy(), want[0])
    np.testing.assert_array_equal(depths.numpy(), want[1])
    assert ids.tolist() == want[2]
    np.testing.assert_array_equal(scores.numpy(), want[3])


def test_kernel_tree_orders_equal_log_probs_by_token_id():
    lp = torch.tensor([[-1.0, -2.0, -1.0, -3.0, -2.0, -1.0]])
    assert _kernel().best_first_tree(lp, 6)[2].tolist() == [0, 2, 5, 1, 4, 3]
    assert _kernel().best_first_tree(lp, 2)[2].tolist() == [0, 2]
    with pytest.raises(RuntimeError, match="budget must be >= 1"):
        _kernel().best_first_tree(lp, 0)
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        _kernel().best_first_tree(lp.double(), 2)


@pytest.mark.parametrize("seed", range(8))
def test_kernel_visibility_is_the_ancestor_matrix(seed):
    gen = torch.Generator().manual_seed(seed)
    lp = _distinct_logprobs(gen, 6, 30, scale=1.5)
    parents, depths, _, _ = best_first_nodes(lp, 1 + seed * 5)
    ancestors, positions = _kernel().tree_visibility(parents, depths, 41)
    np.testing.assert_array_equal(ancestors.numpy(), ancestor_matrix(parents, depths))
    assert positions.tolist() == (depths + 41).tolist()


def test_kernel_visibility_refuses_a_parent_after_its_child():
    with pytest.raises(RuntimeError, match="node 2 has parent 3; parents must precede their children"):
        _kernel().tree_visibility(np.array([-1, 0, 3, 1]), np.array([0, 1, 2, 2]), 0)


def test_kernel_tree_tokens_map_draft_ids_to_target_ids():
    d2t = torch.tensor([5, 0, 7, 1])  # draft id j -> target id j + d2t[j]
    ids = torch.tensor([2, 0, 3])
    assert _kernel().tree_tokens(9, ids, d2t).tolist() == [9, 9, 5, 4]
    assert _kernel().tree_tokens(9, ids, None).tolist() == [9, 2, 0, 3]
    with pytest.raises(RuntimeError, match="draft id 4 is outside the draft vocabulary"):
        _kernel().tree_tokens(9, torch.tensor([4]), d2t)


@pytest.mark.parametrize("seed", range(10))
def test_kernel_greedy_walk_is_argmax_then_walk(seed):
    """greedy_walk: torch.argmax at every node (first maximum, NaN first) and tree.walk's path, on random trees whose
    tokens often match their parent's choice."""
    gen = torch.Generator().manual_seed(seed)
    parents, depths, _, _ = best_first_nodes(_distinct_logprobs(gen, 5, 7, scale=1.0), 1 + 3 * seed)
    n = len(parents)
    logits = torch.randn(n, 50, generator=gen)
    logits[:, 3] = logits.max(dim=-1).values  # ties: the first maximum wins
    if seed % 3 == 0:
        logits[0, 17] = float("nan")
    choices = logits.argmax(dim=-1)
    tokens = torch.where(torch.rand(n, generator=gen) < 0.7, choices[torch.from_numpy(parents).clamp(min=0)],
                         torch.randint(0, 50, (n,), generator=gen))
    tree = DraftTree(tokens, parents, depths)
    assert _kernel().greedy_walk(logits, parents, tokens) == walk(tree, None, choices)
