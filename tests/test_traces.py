"""Per-step tree traces: what the engine records, and the reductions the plots draw."""
import math

import pytest
import torch

from conftest import plant_oracle, run
from ddtree.engine import traces as tr
from ddtree.api import Pair
from ddtree.bench.testing import random_pair


def step(parents, logprobs, accepted):
    return dict(parents=parents, depths=_depths(parents), draft_logprobs=logprobs, accepted=accepted,
                tokens=list(range(len(parents))), choices=[0] * len(parents))


def _depths(parents):
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


# root 0; children 1 (log 0.5) and 2 (log 0.25) of the root; 3 under 1 (log 0.5); 4 under 2
TREE = [-1, 0, 0, 1, 2]
LP = [0.0, math.log(0.5), math.log(0.25), math.log(0.5), math.log(0.9)]


def test_reductions_by_hand():
    records = [step(TREE, LP, [0, 1, 3]),  # the first choices accepted twice: depth 2
               step(TREE, LP, [0, 2]),  # the root's second choice accepted, then nothing
               step(TREE, LP, [0])]  # nothing accepted
    depth = tr.acceptance_by_depth(records)
    assert depth[1] == (2 / 3, 2 / 3, 3) and depth[2] == (1 / 3, 1 / 2, 3)
    assert tr.sibling_ranks(records[0]) == [0, 0, 1, 0, 0]
    rank = tr.acceptance_by_rank(records)
    # judged nodes (parent on the accepted path): rank 0: 1, 3 | 1, 4 | 1 -> 2 of 5; rank 1: node 2 thrice -> 1 of 3
    assert rank == {0: (2 / 5, 5), 1: (1 / 3, 3)}
    assert tr.path_logprobs(records[0])[3] == pytest.approx(math.log(0.25))
    cal = tr.calibration(records, bins=4)
    assert cal["by_length"][2] == (pytest.approx(0.25), 1) and cal["by_length"][0] == (1.0, 1)
    assert sum(n for _, _, n in cal["reliability"]) == 12  # every draft node of every step
    for mean_p, frac, _ in cal["reliability"]:
        assert 0 <= mean_p <= 1 and 0 <= frac <= 1


@pytest.mark.parametrize("fused", [True, False], ids=["row-logits", "all-logits"])  # float32 CPU: RowLogits
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["dflash", "ddtree:12"])
def test_engine_traces_are_consistent(method, temperature, fused):
    target, drafter = random_pair("qwen3", seed=7, block_size=6, init_scale=0.25, fused=fused)
    assert target.row_logits == fused
    assert torch.get_num_threads() == 1 and target.lazy_logits(13) == fused  # conftest: one thread
    pair = Pair(target, drafter, None)
    prompt = [4, 8, 15, 16, 23]
    reference, _ = run(target, None, prompt, "ar", max_new_tokens=30)
    plant_oracle(drafter, prompt + reference + [0] * 300, seed=1, top1=0.7)
    res = pair.generate(prompt, method=method, max_new_tokens=30, temperature=temperature, seed=3, trace=True)
    assert len(res.trace) == res.stats.steps
    emitted = res.token_ids[:1]  # the prefill's token, then each step's accepted drafts and bonus
    for rec, n in zip(res.trace, res.stats.acceptance_lengths):
        path, choices, tokens = rec["accepted"], rec["choices"], rec["tokens"]
        assert path[0] == 0 and len(path) == n and len(tokens) == len(rec["parents"]) == len(rec["depths"])
        for parent, child in zip(path, path[1:]):  # each accepted draft is the target's choice at its parent
            assert rec["parents"][child] == parent and tokens[child] == choices[parent]
        assert rec["draft_logprobs"][0] == 0.0 and all(lp <= 1e-6 for lp in rec["draft_logprobs"])
        lazy = target.lazy_logits(len(tokens))  # RowLogits: float32 CPU on one thread from 12 nodes (ddtree:12)
        if temperature == 0 and not lazy:  # every node's choice from one argmax over all logits
            assert all(c >= 0 for c in choices)
        else:  # drawn (sampled, or read from RowLogits) only where the walk looked
            assert {i for i, c in enumerate(choices) if c >= 0} == set(path)
        emitted += [choices[i] for i in path]
    assert emitted[:len(res.token_ids)] == res.token_ids
    if temperature == 0:
        assert res.token_ids == reference
    assert pair.generate(prompt, method=method, max_new_tokens=5).trace is None  # off by default


def test_draft_logprobs_use_the_draft_vocabulary():
    """With a reduced draft vocabulary the logits are indexed by draft ids, not by the target ids in the tree."""
    import numpy as np
    import torch

    from ddtree.engine.tree import DraftTree

    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]))  # 2 block positions, 3 draft ids
    tree = DraftTree(torch.tensor([9, 40, 41, 42]), np.array([-1, 0, 0, 1]), np.array([0, 1, 1, 2]),
                     draft_logits=logits, draft_ids=torch.tensor([0, 1, 2]))  # target ids 40..42
    rec = tr.step_record(tree, [40, 42, -1, -1], [0, 1])
    assert rec["draft_logprobs"] == pytest.approx([0.0, math.log(0.7), math.log(0.2), math.log(0.25)])
    assert rec["tokens"] == [9, 40, 41, 42] and rec["accepted"] == [0, 1]
