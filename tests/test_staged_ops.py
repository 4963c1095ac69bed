"""The staged step operations (ddtree/engine/staged_ops.py): the reference ops' trees, tokens, masks and walks with the
step's bookkeeping on the host, chosen for a target whose passes take host inputs (the CUDA-graph runtime, run here
uncaptured with Triton's interpreter); on a GPU, no implicit synchronization in a step. Decoding through them, lossless
with two copies back per greedy step: tests/test_gpu_runtime.py."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from ddtree.bench.testing import add_markov_head, random_pair  # noqa: E402
from ddtree.models.drafter import untrained_drafter  # noqa: E402
from ddtree.engine.decoder import Decoder, make_method  # noqa: E402
from ddtree.engine.staged_ops import StagedStepOps, step_ops_for  # noqa: E402
from ddtree.engine.step_ops import TorchStepOps  # noqa: E402
from ddtree.engine.tree import DraftTree  # noqa: E402
from ddtree.base.config import SamplingParams  # noqa: E402

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

from ddtree.runtime.gpu import runtime as gpu  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def pair():
    """The reference models with the Triton backend (the runtime's), the drafter on the target's vocabulary."""
    target, drafter = random_pair("qwen3", seed=3, num_draft_layers=2, block_size=8, runtime=False, device=DEVICE,
                                  init_scale=0.25)
    target.attention_backend = drafter.attention_backend = "triton"
    return target, drafter


@pytest.fixture(scope="module")
def reduced(pair):
    """A drafter of a reduced draft vocabulary (its ids map to the target's through d2t)."""
    return untrained_drafter(pair[0], 2, 8, seed=5, draft_vocab=torch.arange(0, 96, 2))


def distinct_logprobs(seed: int, depth: int, vocab: int) -> torch.Tensor:
    """[depth, vocab] log-probs without ties (top-k orders equal values as it likes)."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randperm(depth * vocab, generator=gen).view(depth, vocab).float() * 1e-3
    return (torch.randn(depth, vocab, generator=gen) * 3 + noise).log_softmax(-1).to(DEVICE)


def test_the_runtime_that_takes_host_inputs_gets_the_staged_ops(pair):
    target, drafter = pair
    rt, rd = gpu.attach(target, drafter, graphs=False)
    assert rt.host_inputs and isinstance(step_ops_for(rt), StagedStepOps)
    assert isinstance(Decoder(rt, rd).ops, StagedStepOps)
    assert not target.host_inputs and isinstance(Decoder(target, drafter).ops, TorchStepOps)


@pytest.mark.parametrize("seed,depth,budget", [(0, 1, 1), (1, 3, 5), (2, 7, 16), (3, 7, 60)])
def test_trees_tokens_and_visibility_equal_the_reference_ops(reduced, seed, depth, budget):
    """Budget 60 reads past the 32 ranks a depth the reference ops fetch first: one top-k of the whole budget gives
    the same heap. The tokens map the draft ids through d2t on the host."""
    drafter = reduced
    staged, ref = StagedStepOps(DEVICE), TorchStepOps()
    lp = distinct_logprobs(seed, depth, drafter.cfg.draft_vocab_size)
    got = staged.tree_nodes(drafter, lp, staged.root(7, DEVICE), budget)
    want = ref.tree_nodes(drafter, lp, ref.root(7, DEVICE), budget)
    assert staged.waits == 1 and got[2].device.type == "cpu"
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.cpu() if torch.is_tensor(b) else b))
    np.testing.assert_allclose(got[3], want[3], rtol=1e-6)
    tokens = staged.tree_tokens(drafter, staged.root(7, DEVICE), got[2])
    assert tokens.device.type == "cpu" and staged.waits == 1  # the ids were on the host already
    assert torch.equal(tokens, ref.tree_tokens(drafter, ref.root(7, DEVICE), want[2]).cpu())
    parents, depths = got[:2]
    (sa, sp), (ra, rp) = (ops.visibility(parents, depths, 13, DEVICE) for ops in (staged, ref))
    assert torch.equal(sp, rp.cpu()) and (sa is None) == (ra is None) == (len(parents) == 1)
    assert sa is None or torch.equal(sa, ra.cpu())


@pytest.mark.parametrize("seed", range(3))
def test_walks_and_chains_equal_the_reference_ops(pair, reduced, seed):
    """A tree whose tokens follow the target's choices for a while, so that the walk goes deep."""
    target, drafter = pair[0], reduced
    staged, ref = StagedStepOps(DEVICE), TorchStepOps()
    lp = distinct_logprobs(seed, 5, drafter.cfg.draft_vocab_size)
    parents, depths, ids, _ = ref.tree_nodes(drafter, lp, ref.root(1, DEVICE), 12)
    tokens = ref.tree_tokens(drafter, ref.root(1, DEVICE), ids)
    logits = torch.randn(len(parents), target.cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    for i in range(1, len(parents)):  # node i's token is its parent's argmax for most nodes
        if (i + seed) % 4:
            logits[parents[i], int(tokens[i])] = 100.0
    logits = logits.to(DEVICE)
    ref_tree, staged_tree = DraftTree(tokens, parents, depths), DraftTree(tokens.cpu(), parents, depths)
    ancestors, _ = ref.visibility(parents, depths, 0, DEVICE)
    assert staged.greedy_walk(staged_tree, None, logits) == ref.greedy_walk(ref_tree, ancestors, logits)
    chain = staged.chain_ids(drafter, lp, staged.root(1, DEVICE))
    assert chain.device.type == "cpu" and torch.equal(chain, ref.chain_ids(drafter, lp, ref.root(1, DEVICE)).cpu())
    assert staged.waits == 2
    assert torch.equal(staged.path_rows([0, 2, 5], DEVICE), torch.tensor([0, 2, 5], device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_greedy_step_synchronizes_only_where_it_copies_back(pair):
    """With CUDA graphs, after the prefill no step synchronizes implicitly (no .item(), .tolist(), pageable copies):
    torch's sync debug mode raises on any, while the two explicit waits per step are allowed."""
    target, drafter = pair
    rt, rd = gpu.attach(target, drafter, graphs=True)
    dec = Decoder(rt, rd)
    prompt = list(range(3, 40))
    for method in ("ar", "dflash", "ddtree:8", "ddtree:8+lookup"):
        expected, _ = dec.generate(prompt, make_method(method, None, None, rd), SamplingParams(), 24)  # captures
        steps = dec.steps(prompt, make_method(method, None, None, rd), SamplingParams(), 24)
        got = list(next(steps))  # the prefill: its prompt upload and first token read back are not a step's
        torch.cuda.set_sync_debug_mode("error")
        try:
            while True:
                got.extend(next(steps))
        except StopIteration:
            pass
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got == expected, method


def test_a_markov_heads_trees_and_chains_equal_the_reference_ops(pair):
    """With a Markov head the trees and chains come from the head's own builders (on the device), then go to the
    host in one copy."""
    target, _ = pair
    drafter = add_markov_head(untrained_drafter(target, 2, 8, seed=6), seed=2)
    staged, ref = StagedStepOps(DEVICE), TorchStepOps()
    lp = distinct_logprobs(4, 5, drafter.cfg.draft_vocab)
    for budget in (3, 12):
        got = staged.tree_nodes(drafter, lp, staged.root(9, DEVICE), budget)
        want = ref.tree_nodes(drafter, lp, ref.root(9, DEVICE), budget)
        for a, b in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b.cpu() if torch.is_tensor(b) else b))
        assert got[2].device.type == "cpu"
    chain = staged.chain_ids(drafter, lp, staged.root(9, DEVICE))
    assert torch.equal(chain, ref.chain_ids(drafter, lp, ref.root(9, DEVICE)).cpu())
    assert staged.waits == 3


def test_the_host_copy_of_d2t_follows_a_vocabulary_written_in_place(pair):
    """set_draft_vocab writes d2t in place: the next tokens map through the new table, not a stale host copy."""
    target, _ = pair
    drafter = untrained_drafter(target, 2, 8, seed=5, draft_vocab=torch.arange(0, 96, 2))
    staged, ids = StagedStepOps(DEVICE), torch.tensor([0, 3, 5])
    assert staged.tree_tokens(drafter, staged.root(1, DEVICE), ids).tolist() == [1, 0, 6, 10]
    drafter.set_draft_vocab(torch.arange(1, 96, 2), target.lm_head.weight)  # the odd ids now
    assert staged.tree_tokens(drafter, staged.root(1, DEVICE), ids).tolist() == [1, 1, 7, 11]
