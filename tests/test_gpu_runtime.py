"""The CUDA-graph runtime (ddtree/runtime/gpu/runtime.py). On a CPU its padded, device-indexed passes run uncaptured
(graphs=False) with Triton's interpreter, which checks everything but the capture; on a GPU the captured replays
are checked against the same passes run uncaptured."""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from conftest import plant_oracle, run  # noqa: E402
from ddtree.models.attention import Visibility  # noqa: E402
from ddtree.runtime.gpu import runtime as gpu  # noqa: E402
from ddtree.bench.testing import random_pair  # noqa: E402
from ddtree.engine.tree import ancestor_matrix  # noqa: E402
from ddtree.engine.decoder import Decoder, make_method  # noqa: E402
from ddtree.base.config import SamplingParams  # noqa: E402

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def reference_pair(seed=3, dtype=torch.float32, **kw):
    target, drafter = random_pair("qwen3", seed=seed, num_draft_layers=2, block_size=8, runtime=False,
                                  dtype=dtype, device=DEVICE, init_scale=0.25, **kw)
    target.attention_backend = drafter.attention_backend = "triton"
    return target, drafter


def test_buckets():
    assert [gpu.bucket(n) for n in (1, 2, 3, 5, 6, 16, 17, 18, 129, 130, 257, 512, 513)] == \
        [1, 2, 3, 5, 8, 16, 17, 32, 129, 256, 257, 512, 513]  # ddtree:B's B + 1 rows have their own bucket
    assert gpu.bucket(514) is None


def test_the_host_packer_gives_the_kernels_mask_layout():
    """The staged inputs' numpy packer (runtime._pack_rows) against the kernel module's pack_ancestor_bits, on a
    branching tree of 70 nodes (three words a row)."""
    import numpy as np

    from ddtree.base.kernel_files import kernel_module

    rng = random.Random(1)
    parents = np.array([-1] + [rng.randrange(i) for i in range(1, 70)])
    depths = np.zeros(70, dtype=np.int64)
    for i in range(1, 70):
        depths[i] = depths[parents[i]] + 1
    anc = ancestor_matrix(parents, depths)
    want = kernel_module("tree_attention").pack_ancestor_bits(torch.from_numpy(anc)).numpy()
    np.testing.assert_array_equal(gpu._pack_rows(anc, 3), want)


def test_a_padded_pass_equals_the_reference_pass():
    """A tree of 6 nodes verified in the bucket of 8 (padding rows, device past length, K/V written at device rows):
    the same logits, taps and committed cache rows as the reference's eager pass over the 6 nodes."""
    ref, _ = reference_pair()
    rt, _ = gpu.attach(ref, None, graphs=False)
    parents = [-1, 0, 0, 1, 3, 2]
    depths = [0, 1, 1, 2, 3, 2]
    import numpy as np

    anc = torch.from_numpy(ancestor_matrix(np.array(parents), np.array(depths))).to(DEVICE)
    prompt = torch.tensor([5, 7, 11, 13, 17, 19, 23], device=DEVICE)
    tokens = torch.tensor([29, 31, 37, 41, 43, 47], device=DEVICE)
    out = []
    for model in (ref, rt):
        cache = model.new_cache(40)
        model(prompt, torch.arange(7, device=DEVICE), cache, Visibility.causal(0, 7, DEVICE), last_only=True)
        cache.commit(7)
        positions = torch.tensor(depths, device=DEVICE) + 7
        o = model(tokens, positions, cache, Visibility(7, anc), (0, 1))
        cache.commit(3, torch.tensor([0, 1, 3], device=DEVICE))
        out.append((o.logits.clone(), o.taps.clone(), cache.k[:, :, :10].clone(), cache.v[:, :, :10].clone()))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_decoding_in_the_runtime_is_lossless_with_two_waits_a_step():
    """ar, dflash and ddtree at several budgets, with and without the context lookup (an oracle drafter, so trees are
    deep and branchy and accepted paths need compaction) decode the reference's ar tokens on seeded random prompts,
    through the staged step operations (engine/staged_ops.py): two copies back per drafted step (the draft's top-k,
    the target's choices), one per plain step."""
    ref, drafter = reference_pair(seed=4)
    rng = random.Random(0)
    for _ in range(2):
        prompt = [rng.randrange(96) for _ in range(rng.randint(3, 20))]
        expected, _ = run(ref, None, prompt, "ar", max_new_tokens=20)
        rt, rd = gpu.attach(ref, drafter, graphs=False)
        plant_oracle(rd, prompt + expected + [0] * 40, seed=1, top1=0.7)
        dec = Decoder(rt, rd)
        for method, budget in [("ar", 1), ("dflash", 1), ("ddtree", 3), ("ddtree", 12), ("ddtree:12+lookup", None),
                               ("ddtree", 40)]:
            before = dec.ops.waits
            tokens, stats = dec.generate(prompt, make_method(method, budget, None, rd), SamplingParams(), 20)
            assert tokens == expected, (method, budget)
            if method == "ddtree" and budget == 12:
                assert stats.tau > 1.5  # the oracle's trees were accepted deep: compaction was exercised
            steps = len(stats.acceptance_lengths)
            assert dec.ops.waits - before == steps * (1 if method == "ar" else 2), (method, budget)


def test_the_drafters_passes_equal_the_reference():
    """The context pass (padded to its bucket) and the block pass give the reference drafter's K/V and logits."""
    ref, drafter = reference_pair(seed=5)
    rt, rd = gpu.attach(ref, drafter, graphs=False)
    features = torch.randn(3, 2 * ref.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    bonus = torch.tensor([9], device=DEVICE)
    outs = []
    for model in (drafter, rd):
        cache = model.new_cache(30)
        model.add_context(cache, features)
        model.add_context(cache, features[:2])
        logits = model.draft(cache, bonus, 6).clone()
        outs.append((logits, cache.length, cache.k[:, :, :5].clone(), cache.v[:, :, :5].clone()))
    assert outs[0][1] == outs[1][1] == 5
    for a, b in zip(outs[0][:1] + outs[0][2:], outs[1][:1] + outs[1][2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_runtime_owns_one_cache_per_model():
    ref, drafter = reference_pair(seed=6)
    rt, rd = gpu.attach(ref, drafter, graphs=False)
    a = rt.new_cache(50)
    a.length = 7
    b = rt.new_cache(40)
    assert b is a and b.length == 0 and b.capacity == 40 and b.room == 40  # reused, reset, the asked capacity
    assert b.k.shape[2] >= 40 + gpu.BUCKETS[-1]  # a padded pass may write past the last real row
    c = rt.new_cache(3000)
    assert c is not a and c.capacity == 3000
    assert rd.new_cache(10) is not c
    assert isinstance(rt, gpu.GPUTarget) and rt.model is ref  # the reference, as it is
    assert gpu.attach(rt, rd) == (rt, rd)


def test_applies_only_to_the_own_target_on_cuda_with_triton(monkeypatch):
    ref, _ = reference_pair(seed=7)
    assert gpu.applies(ref) == torch.cuda.is_available()
    ref.attention_backend = "sdpa"
    assert not gpu.applies(ref)
    ref.attention_backend = "triton"
    monkeypatch.setenv("DDTREE_CUDA_GRAPHS", "0")  # read by load() only: a pair without graphs does not attach
    assert gpu.applies(ref) == torch.cuda.is_available()  # (tests/test_options.py)


@needs_cuda
def test_graph_replays_equal_uncaptured_passes_bf16():
    """On a GPU: decoding with captured graphs gives the same tokens, bit for bit the same step by step, as the same
    passes run uncaptured, for ar, dflash and ddtree (bf16, Qwen3-shaped)."""
    ref, drafter = reference_pair(seed=8, dtype=torch.bfloat16)
    prompt = list(range(3, 40))
    expected, _ = run(ref, None, prompt, "ar", max_new_tokens=24)
    plain = gpu.attach(ref, drafter, graphs=False)
    graphed = gpu.GPUTarget(ref, graphs=True)
    graphed = (graphed, gpu.GPUDrafter(drafter.bind(graphed), graphs=True))
    for pair in (plain, graphed):
        plant_oracle(pair[1], prompt + expected + [0] * 40, seed=2, top1=0.7)
    for method, budget in [("ar", 1), ("dflash", 1), ("ddtree", 8), ("ddtree", 64)]:
        a, _ = run(*plain, prompt, method, budget, max_new_tokens=24)
        b, _ = run(*graphed, prompt, method, budget, max_new_tokens=24)
        assert a == b, (method, budget)


@needs_cuda
def test_graphed_drafts_equal_uncaptured_ones():
    """On a GPU: the captured context and block passes give the uncaptured passes' K/V and logits bit for bit, step
    after step as the context grows (the past length read on the device each replay)."""
    ref, drafter = reference_pair(seed=9, dtype=torch.bfloat16)
    runs = []
    for graphs in (False, True):
        rd = gpu.GPUDrafter(drafter, graphs=graphs)
        cache = rd.new_cache(64)
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        out = []
        for n in (3, 1, 5, 2, 8):
            rd.add_context(cache, torch.randn(n, 2 * ref.cfg.hidden_size, generator=gen, device=DEVICE,
                                              dtype=torch.bfloat16))
            out.append(rd.draft(cache, torch.tensor([n], device=DEVICE), 8).clone())
        out.append(cache.k[:, :, :cache.length].clone())
        runs.append(out)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_replaced_weight_drops_the_passes():
    """Graphs read the weights' storage: a parameter replaced (not written in place) means capturing again, which
    check_fresh (before each generation) sees."""
    ref, _ = reference_pair(seed=10)
    rt, _ = gpu.attach(ref, None, graphs=False)
    run(rt, None, [1, 2, 3], "ar", max_new_tokens=3)
    assert rt._passes
    rt.check_fresh()
    assert rt._passes  # nothing replaced: kept
    ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach().clone())
    rt.check_fresh()
    assert not rt._passes
