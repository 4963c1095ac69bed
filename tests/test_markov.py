"""The Markov head (ddtree/models/markov.py): its conditionals, the trees built from them, its file format, and
decoding with it (exactly plain decoding's tokens, greedy and sampled)."""
import itertools
import json

import numpy as np
import pytest
import torch

from conftest import plant_oracle, run
from ddtree.base.config import SamplingParams
from ddtree.models.drafter import DFlashDrafter
from ddtree.engine.decoder import Decoder, make_method
from ddtree.engine.step_ops import TorchStepOps
from ddtree.models.markov import (MarkovHead, conditional_best_first, conditional_chain, conditional_logprobs,
                           conditional_table, head_chain_ids, head_tree_nodes)
from ddtree.bench.testing import add_markov_head, random_pair
from ddtree.engine.tree import best_first_nodes


def random_head(hidden=16, vocab=12, positions=4, rank=3, candidates=5, seed=0):
    head = MarkovHead(hidden, vocab, positions, rank, candidates)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.proj.copy_(torch.randn(head.proj.shape, generator=gen))
        head.out.copy_(torch.randn(head.out.shape, generator=gen))
        head.scale.copy_(torch.rand(positions, generator=gen) + 0.5)
    return head


def block_logprobs(depth, vocab, seed):
    return (torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * 2).log_softmax(-1)


def test_conditionals_are_distributions_and_a_fresh_head_is_the_identity():
    lp = block_logprobs(4, 12, 0)
    cand_lp, cand_ids = lp.topk(5, dim=-1)
    emb = torch.randn(4, 7, 16)
    for head, identity in ((MarkovHead(16, 12, 4, 3, 5), True), (random_head(), False)):
        cond, norm = conditional_logprobs(head, cand_lp, cand_ids, head.code(emb), torch.arange(4))
        outside = (1 - cand_lp.exp().sum(-1))[:, None] / norm.exp()  # [D, P] the mass left to non-candidates
        torch.testing.assert_close(cond.exp().sum(-1) + outside, torch.ones(4, 7))
        if identity:
            torch.testing.assert_close(cond, cand_lp[:, None, :].expand_as(cond))
        else:
            assert (cond - cand_lp[:, None, :]).abs().max() > 0.1


def stub_drafter(head, embed, d2t=None):
    """What conditional_table and the kernel path read of a drafter; d2t: a reduced draft vocabulary's offsets."""
    class Drafter:
        markov = head
        target = type("T", (), {"embed": staticmethod(lambda ids: embed[ids])})
        cfg = type("C", (), {"model": type("M", (), {"vocab_size": embed.shape[0]}), "reduced_vocab": d2t is not None})

        @staticmethod
        def to_target_ids(ids):
            return ids if d2t is None else ids + d2t[ids]
    Drafter.d2t = d2t
    return Drafter


def tables(head, lp, root, embed):
    return conditional_table(stub_drafter(head, embed), lp, root)


def test_the_hosts_table_is_the_training_arithmetic():
    """conditional_table (numpy, for the engine) against conditional_logprobs (torch, for training)."""
    head = random_head(hidden=16, vocab=12, positions=4, candidates=5, seed=4)
    embed = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    lp = block_logprobs(4, 12, 2)
    cand_ids, cond = tables(head, lp, 7, embed)
    cand_lp, ids = lp.topk(5, dim=-1)
    np.testing.assert_array_equal(cand_ids, ids.numpy())
    parents = torch.cat([torch.full((1, 5), 7), ids[:-1]])
    want, _ = conditional_logprobs(head, cand_lp, ids, head.code(embed)[parents], torch.arange(4))
    np.testing.assert_allclose(cond, want.detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [1, 2, 5, 9, 20, 60])
def test_a_zero_head_builds_the_plain_tree(budget):
    lp = block_logprobs(4, 12, budget)
    head = MarkovHead(16, 12, 4, 3, 5)
    embed = torch.randn(12, 16)
    plain = best_first_nodes(lp.topk(5, dim=-1).values, budget)  # the marginals' tree over the same candidates
    cand_ids, cond = tables(head, lp, 3, embed)
    parents, depths, tokens, scores = conditional_best_first(cand_ids, cond, budget)
    ranks = [int(np.where(cand_ids[d - 1] == t)[0][0]) for d, t in zip(depths[1:], tokens)]
    np.testing.assert_array_equal(parents, plain[0])
    np.testing.assert_array_equal(depths, plain[1])
    assert ranks == plain[2]
    np.testing.assert_allclose(scores, plain[3], rtol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_conditional_tree_holds_the_best_paths(seed, budget):
    """Brute force: every root path (each token drawn from its parent's conditional) scored, the best `budget`
    of them form the tree (as scores: ties may swap equal paths)."""
    depth, vocab, m = 3, 8, 4
    head = random_head(hidden=16, vocab=vocab, positions=depth, candidates=m, seed=seed)
    embed = torch.randn(vocab, 16, generator=torch.Generator().manual_seed(seed + 100))
    lp = block_logprobs(depth, vocab, seed)
    cand_ids, cond = tables(head, lp, 2, embed)
    parents, depths, tokens, scores = conditional_best_first(cand_ids, cond, budget)
    # every path of candidate indices, scored by summing its conditionals
    paths = []
    for length in range(1, depth + 1):
        for path in itertools.product(range(m), repeat=length):
            rows = (0,) + path[:-1]
            paths.append(sum(float(cond[d, rows[d], path[d]]) for d in range(length)))
    best = sorted(paths, reverse=True)[:budget]
    np.testing.assert_allclose(sorted(scores, reverse=True), best, rtol=1e-5)
    assert all(parents[i] < i for i in range(1, len(parents)))  # a tree in tree order
    assert list(scores) == sorted(scores, reverse=True)  # pop order: any prefix is a tree
    assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, len(parents)))


def test_siblings_get_their_own_continuations():
    """With a head, children of two depth-1 siblings differ where their parents' biases differ."""
    head = random_head(hidden=16, vocab=12, positions=4, candidates=6, seed=3)
    with torch.no_grad():
        head.scale.fill_(4.0)
    embed = torch.randn(12, 16, generator=torch.Generator().manual_seed(9))
    lp = block_logprobs(4, 12, 5)
    cand_ids, cond = tables(head, lp, 1, embed)
    parents, depths, tokens, _ = conditional_best_first(cand_ids, cond, 40)
    firsts = {}
    for i in range(1, len(parents)):
        if depths[i] == 2 and parents[i] not in firsts:
            firsts[int(parents[i])] = tokens[i - 1]
    assert len(set(firsts.values())) > 1
    chain = conditional_chain(cand_ids, cond)
    assert chain[0] == tokens[0] and len(chain) == 4


def test_save_and_load_keep_the_head(tmp_path):
    target, drafter = random_pair("qwen3", seed=4, block_size=6, runtime=False)
    add_markov_head(drafter, rank=4, candidates=7, seed=1)
    drafter.save(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["markov_head"] == {"rank": 4, "candidates": 7} and "markov_head" not in config["dflash_config"]
    loaded = DFlashDrafter.load(tmp_path / "d", target=target)
    assert loaded.cfg.markov == (4, 7)
    for name in ("proj", "out", "scale"):
        torch.testing.assert_close(getattr(loaded.markov, name), getattr(drafter.markov, name))
    plain = random_pair("qwen3", seed=4, block_size=6, runtime=False)[1]
    plain.save(tmp_path / "p")
    assert "markov" not in (tmp_path / "p" / "config.json").read_text()
    assert DFlashDrafter.load(tmp_path / "p").markov is None


def test_tree_nodes_and_chain_without_a_head_are_the_plain_ones():
    _, drafter = random_pair("llama", seed=2, block_size=6)
    logits = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    lp = logits.log_softmax(-1)
    ops = TorchStepOps()
    got, want = ops.tree_nodes(drafter, lp, torch.tensor([3]), 9), best_first_nodes(lp, 9)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ops.chain_ids(drafter, logits, torch.tensor([3])).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_a_head_matches_ar(arch):
    """A head changes which tokens the trees hold, never the output: greedy dflash / ddtree equal ar, with a
    random head on an oracle drafter (deep, branchy acceptance) and on the random drafter."""
    target, drafter = random_pair(arch, seed=11, num_draft_layers=2, block_size=8, init_scale=0.25)
    add_markov_head(drafter, seed=5)
    gen = torch.Generator().manual_seed(7)
    changed = 0
    for i in range(6):
        prompt = torch.randint(0, 96, (5 + 3 * i,), generator=gen).tolist()
        reference, _ = run(target, None, prompt, "ar", max_new_tokens=30)
        for oracle in (False, True):
            if oracle:
                plant_oracle(drafter, prompt + reference + [0] * 300, seed=i)
            for method, budget in (("dflash", 1), ("ddtree", 3), ("ddtree", 16), ("ddtree", 64)):
                tokens, stats = run(target, drafter, prompt, method, budget, max_new_tokens=30)
                assert tokens == reference, f"{method}:{budget} with a head diverged on prompt {i}"
            if oracle:
                del drafter.draft  # back to the real draft pass
        # the head changed the trees: compare with the same drafter's marginal trees
        logits = drafter.draft(drafter.new_cache(64), torch.tensor([prompt[-1]]), 8)
        lp, ops = logits.float().log_softmax(-1), target.step_ops or TorchStepOps()
        head, drafter.model.markov = drafter.markov, None
        plain = ops.tree_nodes(drafter, lp, torch.tensor([prompt[-1]]), 16)[2]
        drafter.model.markov = head
        changed += not torch.equal(plain, ops.tree_nodes(drafter, lp, torch.tensor([prompt[-1]]), 16)[2])
    assert changed > 0, "the head never changed a tree: the test would not see it misused"


@pytest.mark.slow
def test_sampling_with_a_head_matches_the_target_distribution():
    from test_sampling import LENGTH, PROMPT, SAMPLES, VOCAB, chi_square_rejects, exact_distribution, sample_counts

    target, drafter = random_pair("llama", seed=21, block_size=4, vocab_size=VOCAB, init_scale=0.6)
    add_markov_head(drafter, candidates=4, seed=2)
    params = SamplingParams(1.0)
    dist = exact_distribution(target, params)
    assert LENGTH == 3 and PROMPT
    for name, budget in (("dflash", 1), ("ddtree", 6)):
        counts = sample_counts(Decoder(target, drafter), make_method(name, budget, None, drafter), params)
        rejected, stat, critical = chi_square_rejects(counts, dist, SAMPLES)
        assert not rejected, f"chi-square {stat:.1f} > critical {critical:.1f}: {name} with a head is not lossless"


# --- the same trees in the CPU kernel (kernels/tree.cpp: markov_tree, markov_chain), as a CPU runtime builds them --
def _kernel():
    from ddtree.runtime.cpu import qlinear

    if not qlinear.cpu_kernel_available("auto"):
        pytest.skip("the CPU kernel does not build here")
    return qlinear.kernel()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 2, 5, 8, 16, 40])
def test_kernel_markov_tree_is_the_python_tree(seed, budget):
    """The kernel's tree and chain against markov.conditional_best_first / conditional_chain over the numpy table:
    the same nodes in the same pop order, the same scores (both in double), with a reduced draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    depth, draft_vocab, vocab, hidden = 7, 40, 64, 16
    head = random_head(hidden=hidden, vocab=draft_vocab, positions=depth, rank=6, candidates=32, seed=seed)
    embed = torch.randn(vocab, hidden, generator=gen)
    d2t = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values - torch.arange(draft_vocab)
    drafter = stub_drafter(head, embed, d2t)
    lp = block_logprobs(depth, draft_vocab, seed + 50)
    root = torch.tensor([int(torch.randint(vocab, (1,), generator=gen))])
    m = min(max(8, budget), 32)
    parents, depths, tokens, scores = conditional_best_first(*conditional_table(drafter, lp, int(root), m), budget)
    got = head_tree_nodes(drafter, lp, root, budget, _kernel())
    np.testing.assert_array_equal(got[0], parents)
    np.testing.assert_array_equal(got[1], depths)
    assert got[2].tolist() == tokens
    np.testing.assert_allclose(got[3], scores, rtol=1e-12)
    python_chain = head_chain_ids(drafter, lp, root)  # no kernel: the numpy table
    assert head_chain_ids(drafter, lp, root, _kernel()).tolist() == python_chain.tolist()


def test_kernel_markov_tree_refuses_bad_input():
    head = random_head(hidden=16, vocab=12, positions=4, candidates=5)
    codes, out_t, scale = head.host_tensors(lambda ids: torch.randn(ids.numel(), 16), 20)
    lp = block_logprobs(4, 12, 0)
    with pytest.raises(RuntimeError, match="root token"):
        _kernel().markov_tree(lp, 20, 4, 5, codes, out_t, scale, None)
    with pytest.raises(RuntimeError, match="do not fit"):
        _kernel().markov_tree(block_logprobs(4, 13, 0), 3, 4, 5, codes, out_t, scale, None)
    with pytest.raises(RuntimeError, match="budget"):
        _kernel().markov_tree(lp, 3, 0, 5, codes, out_t, scale, None)


def test_a_runtime_drafter_builds_the_head_trees_in_the_kernel():
    """tree_nodes / chain_ids of a CPU runtime's step operations (kernel) give what the Python path gives."""
    target, drafter = random_pair("llama", seed=3, block_size=8)
    add_markov_head(drafter, seed=4)
    ops = target.step_ops
    if ops is None:
        pytest.skip("no CPU runtime kernel here")
    logits = torch.randn(7, 96, generator=torch.Generator().manual_seed(2)) * 3
    lp, root = logits.log_softmax(-1), torch.tensor([5])
    for budget in (2, 8, 16):
        got = ops.tree_nodes(drafter, lp, root, budget)
        want = head_tree_nodes(drafter, lp, root, budget)  # no kernel
        for a, b in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(got[3], want[3], rtol=1e-12)  # double sums in another order
    assert ops.chain_ids(drafter, logits, root).tolist() == head_chain_ids(drafter, logits, root).tolist()
