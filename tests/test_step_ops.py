"""The step's host operations (protocol.StepOps): the engine's reference ones (ddtree/engine/step_ops.py) and the CPU
runtime's kernel ones (ddtree/runtime/cpu/step_ops.py) give the same trees, tokens, masks and walks, and the decoding
loop runs the ones its target's runtime chose at load."""
import numpy as np
import pytest
import torch

from ddtree.bench.testing import add_markov_head, random_pair
from ddtree.engine.decoder import Decoder, make_method
from ddtree.engine.step_ops import TorchStepOps
from ddtree.engine.tree import DraftTree
from ddtree.runtime.cpu.step_ops import KernelStepOps


@pytest.fixture(scope="module")
def kernel_pair():
    target, drafter = random_pair("llama", seed=3, num_draft_layers=1, block_size=8)
    if target.step_ops is None:
        pytest.skip("no CPU kernel here")
    return target, drafter


def distinct_logprobs(seed: int, depth: int, vocab: int) -> torch.Tensor:
    """[depth, vocab] log-probs without ties (the two heaps order equal log-probs differently)."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randperm(depth * vocab, generator=gen).view(depth, vocab).float() * 1e-3
    return (torch.randn(depth, vocab, generator=gen) * 3 + noise).log_softmax(-1)


def test_a_cpu_runtime_chooses_the_kernel_ops_and_the_reference_the_engines(kernel_pair):
    target, drafter = kernel_pair
    assert isinstance(Decoder(target, drafter).ops, KernelStepOps)
    assert isinstance(Decoder(target.model, drafter.model).ops, TorchStepOps)  # a target with no runtime


@pytest.mark.parametrize("seed,depth,budget", [(0, 1, 1), (1, 3, 5), (2, 7, 16), (3, 7, 64)])
def test_tree_nodes_tokens_and_visibility_agree(kernel_pair, seed, depth, budget):
    target, drafter = kernel_pair
    kernel, torch_ops = target.step_ops, TorchStepOps()
    lp, bonus = distinct_logprobs(seed, depth, target.cfg.vocab_size), torch.tensor([7])
    got, want = kernel.tree_nodes(drafter, lp, bonus, budget), torch_ops.tree_nodes(drafter, lp, bonus, budget)
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(got[3], want[3], rtol=1e-6)
    parents, depths, ids, _ = want
    assert torch.equal(kernel.tree_tokens(drafter, bonus, ids), torch_ops.tree_tokens(drafter, bonus, ids))
    for start in (0, 13):
        (ka, kp), (ta, tp) = (ops.visibility(parents, depths, start, torch.device("cpu")) for ops in (kernel, torch_ops))
        assert torch.equal(kp, tp) and (ka is None) == (ta is None) == (len(parents) == 1)
        assert ka is None or torch.equal(ka, ta)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_walks_and_chains_agree(kernel_pair, seed):
    """A tree whose tokens follow the target's choices for a while, so the walk goes deep before it stops."""
    target, drafter = kernel_pair
    kernel, torch_ops = target.step_ops, TorchStepOps()
    lp = distinct_logprobs(seed, 5, target.cfg.vocab_size)
    parents, depths, ids, _ = torch_ops.tree_nodes(drafter, lp, torch.tensor([1]), 12)
    tokens = torch_ops.tree_tokens(drafter, torch.tensor([1]), ids)
    logits = torch.randn(len(parents), target.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    for node in range(1, len(parents)):  # the target picks node's token at its parent, for most nodes
        if node % 3:
            logits[parents[node], tokens[node]] = 100.0 + node
    tree = DraftTree(tokens, parents, depths)
    ancestors, _ = torch_ops.visibility(parents, depths, 0, torch.device("cpu"))
    assert kernel.greedy_walk(tree, ancestors, logits) == torch_ops.greedy_walk(tree, ancestors, logits)
    assert torch.equal(kernel.chain_ids(drafter, lp, torch.tensor([1])), torch_ops.chain_ids(drafter, lp, torch.tensor([1])))


def test_a_reduced_vocabulary_and_a_markov_head_agree():
    """The drafter-dependent operations: draft ids mapped through d2t, and trees from a Markov head's conditionals."""
    from ddtree.train.vocab import with_draft_vocab

    target, full = random_pair("qwen3", seed=5, num_draft_layers=1, block_size=6)
    if target.step_ops is None:
        pytest.skip("no CPU kernel here")
    reduced = with_draft_vocab(full, torch.arange(0, 96, 2), target.model.lm_head.weight)
    kernel, torch_ops = target.step_ops, TorchStepOps()
    ids = torch.tensor([0, 5, 47, 3])
    assert kernel.tree_tokens(reduced, torch.tensor([9]), ids).tolist() == [9, 0, 10, 94, 6]
    assert torch_ops.tree_tokens(reduced, torch.tensor([9]), ids).tolist() == [9, 0, 10, 94, 6]
    add_markov_head(full, seed=4)
    lp, root = distinct_logprobs(6, 5, 96), torch.tensor([5])
    for budget in (3, 16):
        got, want = kernel.tree_nodes(full, lp, root, budget), torch_ops.tree_nodes(full, lp, root, budget)
        for a, b in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert torch.equal(kernel.chain_ids(full, lp, root), torch_ops.chain_ids(full, lp, root))


@pytest.mark.parametrize("method", ["dflash", "ddtree:4", "ddtree:32"])
def test_decoding_with_either_ops_gives_the_same_tokens_and_steps(kernel_pair, method):
    target, drafter = kernel_pair
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(8)).tolist()
    plain, _ = Decoder(target).generate(prompt, make_method("ar"), max_new_tokens=24)
    runs = []
    for ops in (target.step_ops, TorchStepOps()):
        decoder = Decoder(target, drafter)
        decoder.ops = ops
        tokens, stats = decoder.generate(prompt, make_method(method, drafter=drafter), max_new_tokens=24)
        runs.append((tokens, stats.acceptance_lengths, stats.tree_sizes))
    assert runs[0] == runs[1] and runs[0][0] == plain
