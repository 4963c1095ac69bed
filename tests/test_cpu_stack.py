"""The target's layers as one C++ call (ddtree/runtime/cpu/stack.py, kernels/decoder.cpp) in the CPU runtime (ddtree/runtime/cpu/runtime.py) against the eager layers
(the reference): the same pass within float32 rounding, the same tokens for every method, rows that do not
depend on the width of the pass, and the cases it must leave to the eager path."""

import pytest
import torch

from conftest import assert_same_tokens, reference_arithmetic
from ddtree.runtime.cpu import stack as cpu_stack
from ddtree.runtime.cpu import weights_watch
from ddtree.runtime.cpu.runtime import CPUTarget, attach
from ddtree.models.attention import Visibility
from ddtree.models.drafter import untrained_drafter
from ddtree.bench.testing import random_pair, random_target

ARCHS = ["llama", "qwen2", "qwen3"]  # qwen2: q/k/v biases; qwen3: per-head q/k norms


def tree_visibility(past: int, n: int) -> Visibility:
    """A small tree: every node sees the root and itself, plus a few deeper ancestor links."""
    anc = torch.eye(n, dtype=torch.bool)
    anc[:, 0] = True
    for child, parent in ((3, 1), (4, 3), (5, 2), (n - 1, n - 2)):
        if child < n and parent < child:
            anc[child] |= anc[parent]
    return Visibility(past, anc)


def current_stack(drafter):
    """The drafter runtime's stack, re-made first where the weights changed (as a draft does)."""
    drafter._current()
    return drafter.stack


def prefilled(target, prompt_len: int = 21, seed: int = 0):
    cache = target.new_cache(prompt_len + 80)
    ids = torch.randint(0, target.cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    target(ids, torch.arange(prompt_len), cache, Visibility.causal(0, prompt_len, "cpu"))  # eager: > 64 rows? no
    cache.commit(prompt_len)
    return cache


def both_paths(target, cache, tokens, vis, taps=(1, 4)):
    """The pass through the stack and through the eager layers, from the same cache state."""
    n, past = tokens.numel(), cache.length
    positions = torch.arange(past, past + n)
    fast = target(tokens, positions, cache, vis, tap_layers=taps)
    k_fast = cache.k[:, :, past:past + n].clone()
    v_fast = cache.v[:, :, past:past + n].clone()
    with reference_arithmetic(target):
        ref = target(tokens, positions, cache, vis, tap_layers=taps)
    return fast, ref, (k_fast, cache.k[:, :, past:past + n]), (v_fast, cache.v[:, :, past:past + n])


def assert_steps_equal_chain(target, cache, tokens, threads: int, logits: bool = True) -> None:
    """A causal chain over `tokens`, then the same tokens as 1-row steps (committed one by one): every step's
    last-layer hidden state (and logits) must be the chain row's, bit for bit, with torch on `threads` threads."""
    past, n, last = cache.length, tokens.numel(), target.cfg.num_layers - 1
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        chain = target(tokens, torch.arange(past, past + n), cache, Visibility.causal(past, n, "cpu"), tap_layers=(last,))
        for i in range(n):
            step = target(tokens[i:i + 1], torch.arange(past + i, past + i + 1), cache, Visibility(past + i, None),
                          tap_layers=(last,))
            cache.commit(1)
            assert torch.equal(step.taps[0], chain.taps[i])
            assert not logits or torch.equal(step.logits[0], chain.logits[i])
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("arch", ARCHS + ["llama-biases"])  # llama with attention_bias: q/k/v and o biases
@pytest.mark.parametrize("shape", ["one", "chain", "tree", "block"])
def test_stack_pass_matches_eager(arch, shape):
    extra = {"attention_bias": True} if arch == "llama-biases" else {}
    target = random_target(arch.removesuffix("-biases"), seed=5, init_scale=0.25, **extra)
    assert extra == {} or target.model.model.layers[0].self_attn.o_proj.bias is not None
    assert target.stack is not None, "a float32 CPU target gets the C++ stack"
    cache = prefilled(target)
    n = {"one": 1, "chain": 7, "tree": 9, "block": 8}[shape]
    vis = {"one": Visibility(cache.length, None), "chain": Visibility.causal(cache.length, n, "cpu"),
           "tree": tree_visibility(cache.length, n), "block": Visibility(cache.length, None)}[shape]
    tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    fast, ref, (k1, k2), (v1, v2) = both_paths(target, cache, tokens, vis, taps=(4, 1))
    torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(fast.taps, ref.taps, rtol=1e-4, atol=1e-4)  # in tap_layers order (4, then 1)
    torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])  # SmolLM2's and Qwen3's: full and several 64-column value blocks
@pytest.mark.parametrize("past", [150, 247, 253])  # key counts off and on the eight-key score tiles and 32-key blocks
def test_stack_attention_over_a_long_past_matches_eager(head_dim, past):
    target = random_target("qwen3", seed=6, init_scale=0.25, head_dim=head_dim)
    cache = prefilled(target, prompt_len=past)
    for n, vis in ((1, Visibility(past, None)), (9, tree_visibility(past, 9))):
        tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        fast, ref, _, _ = both_paths(target, cache, tokens, vis)
        torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(fast.taps, ref.taps, rtol=1e-4, atol=1e-4)


def assert_tree_rows_equal_their_paths(target, cache, threads: int, logits: bool = True) -> None:
    """A tree verify (two branches, the second off the first key's lane) against each node's path decoded as 1-row
    steps: the node's last-layer hidden state (and logits) bit for bit, with torch on `threads` threads. A masked
    sibling must not move a node's key to another lane of the softmax sum (kernels/decoder.cpp)."""
    parents, depth = [-1, 0, 0, 1, 2, 4, 0], [0, 1, 1, 2, 2, 3, 1]
    n, past, last = len(parents), cache.length, target.cfg.num_layers - 1
    anc = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            anc[i] |= anc[parent]
    tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tree = target(tokens, torch.tensor([past + d for d in depth]), cache, Visibility(past, anc), tap_layers=(last,))
        for i in range(n):
            path, j = [], i
            while j >= 0:
                path.insert(0, j)
                j = parents[j]
            cache.length = past
            for j in path:
                step = target(tokens[j:j + 1], torch.tensor([past + depth[j]]), cache, Visibility(cache.length, None),
                              tap_layers=(last,))
                cache.commit(1)
            assert torch.equal(step.taps[0], tree.taps[i]), f"node {i}"
            assert not logits or torch.equal(step.logits[0], tree.logits[i]), f"node {i}"
    finally:
        torch.set_num_threads(saved)
        cache.length = past


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_rows_equal_their_paths_as_one_row_steps(arch, threads):
    """What makes ddtree exactly ar on a CPU: every tree node's pass is its path's 1-row steps, bit for bit (the LM
    head's 1-row GEMV on one thread is torch's, so the logits are compared on two threads)."""
    target = random_target(arch, seed=4, init_scale=0.25, num_layers=3)
    assert_tree_rows_equal_their_paths(target, prefilled(target, prompt_len=13), threads, logits=threads == 2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stack_rows_do_not_depend_on_the_pass_width(arch):
    """2-64-row passes use the row-invariant matmul and compute each row alone: the first rows of a longer chain
    are bit-identical to a shorter chain over the same tokens."""
    target = random_target(arch, seed=2, init_scale=0.25)
    cache = prefilled(target)
    tokens = torch.randint(0, target.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    past = cache.length
    long = target(tokens, torch.arange(past, past + 12), cache, Visibility.causal(past, 12, "cpu"), tap_layers=(2,))
    short = target(tokens[:5], torch.arange(past, past + 5), cache, Visibility.causal(past, 5, "cpu"), tap_layers=(2,))
    assert torch.equal(long.taps[:5], short.taps)
    assert torch.equal(long.logits[:5], short.logits)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_stack_tokens_equal_eager_tokens(arch):
    """ar, dflash and ddtree decode the same tokens with the stack as with the eager layers (fp32)."""
    fast = random_pair(arch, seed=11, num_draft_layers=2, init_scale=0.25)
    ref = random_pair(arch, seed=11, num_draft_layers=2, init_scale=0.25)
    assert fast[0].stack is not None and fast[1].stack is not None
    with reference_arithmetic(ref[0]), reference_arithmetic(ref[1]):  # the drafter's block pass eager too
        assert ref[0].stack is None and ref[1].stack is None
        assert_same_tokens(fast, ref, "the C++ stack and the eager layers", seed=3)


def test_stack_is_left_out_where_it_does_not_apply(monkeypatch):
    assert not isinstance(random_target("llama", dtype=torch.bfloat16), CPUTarget)  # the runtime is float32 only
    assert random_target("llama", fused=False).stack is None  # the reference layout stays eager
    assert random_target("llama", hidden_size=48, num_heads=3, num_kv_heads=1).stack is None  # K % 64 != 0: no row kernel
    target = random_target("llama")
    target.model.fuse(False)
    target.check_fresh()
    target._follow_weights()  # the layers' parameters were replaced: the runtime follows on the next pass
    assert target.stack is None
    target.model.fuse()
    target._follow_weights()
    assert target.stack is not None
    monkeypatch.setattr(cpu_stack.qlinear, "cpu_kernel_available", lambda choice="auto": False)  # no AVX2
    assert random_target("llama").stack is None
    vis = Visibility(3, None)
    assert not cpu_stack.usable(target.stack, cpu_stack.MAX_ROWS + 1, "sdpa", vis)  # wider: CPUTarget splits it
    assert not cpu_stack.usable(target.stack, 4, "triton", vis)
    assert not cpu_stack.usable(target.stack, 4, "sdpa", Visibility(3, None, torch.ones(4, 3, dtype=torch.bool)))
    assert cpu_stack.usable(target.stack, cpu_stack.MAX_ROWS, "sdpa", vis)


def test_stack_refuses_bad_input_with_a_message():
    target = random_target("llama")
    stack, cfg = target.stack, target.cfg
    h = torch.zeros(2, cfg.hidden_size)
    cos = sin = torch.zeros(2, cfg.head_dim)
    cache = target.new_cache(4)
    with pytest.raises(RuntimeError, match="KV cache overflow"):
        stack.forward(h, cos, sin, cache.k, cache.v, 3, None, [])
    with pytest.raises(RuntimeError, match="tap layer 9 outside"):
        stack.forward(h, cos, sin, cache.k, cache.v, 0, None, [9])
    with pytest.raises(RuntimeError, match="float32 CPU"):
        stack.forward(h.double(), cos, sin, cache.k, cache.v, 0, None, [])
    with pytest.raises(RuntimeError, match="ancestors must be bool"):
        stack.forward(h, cos, sin, cache.k, cache.v, 0, torch.ones(3, 3, dtype=torch.bool), [])
    assert cache.length == 0


def test_quantized_stack_matches_eager_and_its_one_row_steps(tmp_path):
    """On a quantized target every matmul is row-invariant, 1 row included, so a chain's rows equal 1-row steps
    bit for bit: dflash and ddtree are then exactly its ar (tests/test_qlinear.py decodes them)."""
    from test_quant_target import quantized

    target = quantized("qwen3", tmp_path)
    assert target.stack is not None
    cache = prefilled(target)
    past, n = cache.length, 6
    tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(8))
    fast, ref, (k1, k2), _ = both_paths(target, cache, tokens, Visibility.causal(past, n, "cpu"))
    torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
    assert_steps_equal_chain(target, cache, tokens, threads=1)
    assert_tree_rows_equal_their_paths(target, cache, threads=1)
    int8 = quantized("qwen3", tmp_path, int8=True)  # activations quantized per row: any bit of difference would show
    assert_tree_rows_equal_their_paths(int8, prefilled(int8), threads=2)


def test_the_integer_mode_keeps_k_v_in_fp16_rounded_as_torch_rounds(tmp_path):
    """quant='gguf-int8' keeps K/V in fp16 (llama.cpp's default; a pass reads half the bytes). The stack rounds each
    row as torch's .half() does: layer 0's rows, written before any attention reads the cache, equal a float32
    cache's rounded. Its passes match the eager layers over the same fp16 cache, tree rows still equal their paths
    as 1-row steps, and a cache whose K and V differ in dtype is refused with a message."""
    from test_quant_target import quantized

    from ddtree.models.kv_cache import KVCache

    target = quantized("qwen3", tmp_path, int8=True)
    assert target.stack is not None and target.describe()["kv_cache"] == "float16"
    c, n = target.cfg, 9
    half, full = target.new_cache(64), KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 64, torch.float32, "cpu")
    assert half.k.dtype == half.v.dtype == target.kv_dtype == torch.float16
    ids = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(5))
    for cache in (half, full):
        target(ids, torch.arange(n), cache, Visibility.causal(0, n, "cpu"))
    assert torch.equal(half.k[0, :, :n], full.k[0, :, :n].half())
    assert torch.equal(half.v[0, :, :n], full.v[0, :, :n].half())
    assert not torch.equal(half.k[0, :, :n].float(), full.k[0, :, :n])  # rounded indeed

    cache = prefilled(target)
    past = cache.length
    tokens = torch.randint(0, c.vocab_size, (6,), generator=torch.Generator().manual_seed(8))
    fast, ref, (k1, k2), (v1, v2) = both_paths(target, cache, tokens, Visibility.causal(past, 6, "cpu"))
    torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(k1.float(), k2.float(), rtol=2e-3, atol=2e-3)  # an fp16 step apart at most
    torch.testing.assert_close(v1.float(), v2.float(), rtol=2e-3, atol=2e-3)
    assert_tree_rows_equal_their_paths(target, prefilled(target), threads=2)
    assert_steps_equal_chain(target, prefilled(target), tokens, threads=2)

    h, cos = torch.zeros(2, c.hidden_size), torch.zeros(2, c.head_dim)
    with pytest.raises(RuntimeError, match="float32 or float16 .* K and V alike"):
        target.stack.forward(h, cos, cos, half.k, full.v, 0, None, [])
    with pytest.raises(RuntimeError, match="float32 or float16"):
        target.stack.forward(h, cos, cos, half.k.double(), half.v.double(), 0, None, [])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafter_stack_matches_eager_and_follows_weight_changes(arch):
    """The drafter's block pass through the stack equals its eager layers; the stack holds copies of the
    concatenated q/k/v and gate/up weights, so an in-place change (an optimizer step) must rebuild it."""
    target, drafter = random_pair(arch, seed=6, num_draft_layers=2, init_scale=0.25)
    cache = drafter.new_cache(64)
    drafter.add_context(cache, torch.randn(20, len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size))
    bonus = torch.tensor([7])

    def eager():
        with reference_arithmetic(drafter):
            return drafter.draft(cache, bonus)

    assert current_stack(drafter) is not None
    torch.testing.assert_close(drafter.draft(cache, bonus), eager(), rtol=1e-5, atol=2e-5)
    first = current_stack(drafter)
    with torch.no_grad():
        drafter.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    assert current_stack(drafter) is not first
    torch.testing.assert_close(drafter.draft(cache, bonus), eager(), rtol=1e-5, atol=2e-5)
    # a parameter REPLACED (attribute assignment, not an in-place write): the cached parameter list is re-read
    second = current_stack(drafter)
    down = drafter.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * -2.0)
    assert current_stack(drafter) is not second
    torch.testing.assert_close(drafter.draft(cache, bonus), eager(), rtol=1e-5, atol=2e-5)
    third = current_stack(drafter)
    assert current_stack(drafter) is third  # nothing changed: no rebuild


def test_rms_norm_kernel_matches_the_eager_norm():
    """The C++ final norm (target and drafter passes through the stack) against ddtree.models.layers.RMSNorm."""
    from ddtree.runtime.cpu import qlinear
    from ddtree.models.layers import RMSNorm

    if not qlinear.cpu_kernel_available():
        pytest.skip("no CPU kernel on this machine")
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    for rows in (1, 3, 17):
        x = torch.randn(rows, 64, generator=gen) * 3
        torch.testing.assert_close(qlinear.kernel().rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: w must be float32"):
        qlinear.kernel().rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)


def test_float_layers_are_row_invariant_on_two_threads():
    """With more than one thread a float32 1-row step takes the row kernel too (faster there), in the layers and
    in the LM head, so a verify's rows get the bits of 1-row steps, logits included (on one thread torch's GEMV
    is faster for the head's one row and the logits differ in the last bits)."""
    target = random_target("qwen3", seed=9, init_scale=0.25)
    assert target.head.transposed is not None, "the 1-row GEMV copy exists; two threads must not take it"
    cache = prefilled(target)
    tokens = torch.randint(0, target.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(2))
    assert_steps_equal_chain(target, cache, tokens, threads=2)


def test_a_bf16_drafter_streams_bf16_weights_with_the_same_bits(monkeypatch):
    """A drafter whose weights are all bfloat16 values (one published in bf16, loaded as float32) gets bf16
    copies in its stack and head: the kernel widens them exactly, so the draft logits equal those of float32
    copies bit for bit."""
    target = random_target("llama", seed=4, init_scale=0.25)
    _, drafter = attach(target, untrained_drafter(target, 2, 8, seed=5, draft_vocab=torch.arange(0, 96, 3)))
    with torch.no_grad():
        for p in drafter.model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(torch.bfloat16).float())
    features = torch.randn(20, len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size)
    cache = drafter.new_cache(64)
    drafter.add_context(cache, features)
    bonus = torch.tensor([7])
    half = drafter.draft(cache, bonus)
    assert current_stack(drafter) is not None and drafter.head.compact.dtype == torch.bfloat16
    assert drafter.context  # the context pass too, on bf16 copies of fc and k;v
    monkeypatch.setattr(cpu_stack, "bf16_copy", lambda w: None)
    drafter.refresh()
    assert torch.equal(drafter.draft(cache, bonus), half)
    assert drafter.head.compact is None
    fresh = drafter.new_cache(64)  # the context on float32 copies: the same bits
    drafter.add_context(fresh, features)
    assert torch.equal(drafter.draft(fresh, bonus), half)


def test_an_8bit_rounded_drafter_streams_8bit_blocks_with_the_same_bits(monkeypatch):
    """A drafter rounded to power-of-two-scaled 8-bit blocks (`train quantize`) gets Q8_0 copies in its stack (layers
    and context pass) and head: their draft logits equal those of bf16 copies of the same values bit for bit."""
    from ddtree.runtime.cpu import qlinear

    target = random_target("llama", seed=4, init_scale=0.25)
    _, drafter = attach(target, untrained_drafter(target, 2, 8, seed=5, draft_vocab=torch.arange(0, 96, 3)))
    with torch.no_grad():
        for p in drafter.model.parameters():
            if p.dim() == 2:
                p.copy_(qlinear.round_po2_q8(p))
    features = torch.randn(20, len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size)
    cache = drafter.new_cache(64)
    drafter.add_context(cache, features)
    bonus, lengths = torch.tensor([7]), (2, 3, 5, 8)
    q8 = [drafter.draft(cache, bonus, length) for length in lengths]
    assert isinstance(drafter.head.compact, qlinear.QWeight) and drafter.head.compact.kind == "Q8_0"
    assert drafter.context
    monkeypatch.setattr(qlinear, "po2_q8", lambda w, exact=True: None)  # bf16 copies of the same values
    drafter.refresh()
    fresh = drafter.new_cache(64)  # the context on bf16 copies too
    drafter.add_context(fresh, features)
    for length, logits in zip(lengths, q8):
        assert torch.equal(drafter.draft(cache, bonus, length), logits)
        assert torch.equal(drafter.draft(fresh, bonus, length), logits)
    assert drafter.head.compact.dtype == torch.bfloat16


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("reduced", [True, False])
def test_a_draft_in_one_call_has_the_bits_of_its_calls_one_by_one(int8, reduced):
    """A draft through DecoderStack.draft (the queued context, the block's inputs, its layers, final norm and head in
    one C++ call) gives the logits and the context K/V of the calls one by one: after a prompt's context wider than a
    stack pass, then steps that queue 1..3 rows, at block lengths 2..16; with the reduced head in the stack, and with
    the target's head (not reduced) applied after it; exact 8-bit copies with float activations, 4-bit copies with int8
    activations."""
    from ddtree.runtime.cpu import qlinear
    from ddtree.runtime.cpu.runtime import CPUDrafter

    target = random_target("llama", seed=4, init_scale=0.25)
    model = untrained_drafter(target, 2, 16, seed=5, draft_vocab=torch.arange(0, 96, 3) if reduced else None)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # 8-bit blocks: the copies that int8 activations run on
                p.copy_(qlinear.round_po2_q8(p))
    target, _ = attach(target, None)
    drafter = CPUDrafter(model.bind(target), target.kernel, int8=int8)
    assert drafter.one_call and drafter.head_in_stack == reduced
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randn(cpu_stack.MAX_ROWS + 6, width, generator=gen)
    steps = [torch.randn(n, width, generator=gen) for n in (1, 3, 2, 1, 2)]

    def run(one_call: bool):
        drafter.one_call = one_call
        cache, logits = drafter.new_cache(128), []
        drafter.add_context(cache, prompt)
        for i, (features, length) in enumerate(zip(steps, (2, 4, 9, 16, 3))):
            logits.append(drafter.draft(cache, torch.tensor([7 + i]), length))
            drafter.add_context(cache, features)
        logits.append(drafter.draft(cache, torch.tensor([1]), 5))
        return logits, cache

    (fused, fused_cache), (calls, calls_cache) = run(True), run(False)
    assert fused_cache.length == calls_cache.length == len(prompt) + sum(len(f) for f in steps)
    assert all(torch.equal(a, b) for a, b in zip(fused, calls))
    rows = slice(0, fused_cache.length)
    assert torch.equal(fused_cache.k[:, :, rows], calls_cache.k[:, :, rows])
    assert torch.equal(fused_cache.v[:, :, rows], calls_cache.v[:, :, rows])


@pytest.mark.parametrize("last_only", [False, True])
def test_a_target_pass_from_token_ids_has_the_bits_of_its_calls_one_by_one(last_only):
    """CPUTarget's pass through DecoderStack.embed_forward (the embedding, the rotary rows, the layers and the final
    norm in one call) equals the embedding, rotary, stack.forward and rms_norm calls one by one, bit for bit: a tree's
    positions and ancestors, with taps."""
    target = random_target("qwen3", seed=9, init_scale=0.25)
    cache = prefilled(target)
    past, n, ref = cache.length, 6, target.model
    tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(2))
    vis = tree_visibility(past, n)
    positions = past + vis.ancestors.sum(1) - 1  # each node's depth
    out = target(tokens, positions, cache, vis, (0, 2), last_only=last_only)
    fast_k = cache.k[:, :, past:past + n].clone()
    with torch.inference_mode():  # as a pass runs
        h = ref.embed(tokens)
        cos, sin = ref.rotary(positions, h.dtype)
        h, taps = target.stack.forward(h, cos, sin, cache.k, cache.v, past, vis.ancestors, [0, 2])
        norm = ref.model.norm
        logits = target.logits(target.kernel.rms_norm(h[-1:] if last_only else h, norm.weight, norm.eps))
    assert torch.equal(out.logits, logits) and torch.equal(out.taps, taps)
    assert torch.equal(cache.k[:, :, past:past + n], fast_k)


def test_one_call_passes_name_what_is_wrong_with_their_input():
    """DecoderStack.draft and .embed_forward check the ids against their tables and the tables' layout."""
    target, drafter = random_pair("llama", seed=3, num_draft_layers=2, init_scale=0.25)
    cos, sin = drafter.model.rotary.table(64, torch.float32)
    cache, embed, vocab = drafter.new_cache(32), target.embed_table(), target.cfg.vocab_size
    with pytest.raises(RuntimeError, match=f"tokens 100000 outside the table's 0..{vocab - 1}"):
        drafter.stack.draft(None, embed, 100000, 1, 4, cos, sin, cache.k, cache.v, 0)
    with pytest.raises(RuntimeError, match="positions 2 outside the table's 0..1"):
        drafter.stack.draft(None, embed, 1, 1, 4, cos[:2], sin[:2], cache.k, cache.v, 0)
    with pytest.raises(RuntimeError, match="a contiguous float32 CPU table .* for the positions"):
        drafter.stack.draft(None, embed, 1, 1, 4, cos[::2], sin[::2], cache.k, cache.v, 0)
    tcache = target.new_cache(32)
    with pytest.raises(RuntimeError, match="tokens and positions must be int64"):
        target.stack.embed_forward(torch.tensor([1, 2], dtype=torch.int32), torch.arange(2), embed, cos, sin,
                                   tcache.k, tcache.v, 0, None, [], False)


def test_drafter_context_through_the_stack_matches_eager():
    """The drafter's context pass (fc, hidden_norm, then every layer's k/v projection, k_norm and RoPE into its
    cache) as one C++ call equals the eager ops' K/V within float32 rounding, at the cache rows after a past."""
    target, drafter = random_pair("llama", seed=3, num_draft_layers=2, init_scale=0.25)  # a Qwen3 drafter
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    features = torch.randn(9, width, generator=torch.Generator().manual_seed(1))
    caches = []
    for stack in (True, False):
        cache = drafter.new_cache(32)
        if stack:
            assert current_stack(drafter) is not None and drafter.context
        else:
            drafter.context = False  # the eager ops (the weights' key unchanged: no rebuild)
        drafter.add_context(cache, features[:5])  # a past, then more rows after it (positions 5..8)
        drafter.flush_context(cache)
        drafter.add_context(cache, features[5:])
        drafter.flush_context(cache)
        assert drafter.context == stack
        caches.append(cache)
    fast, ref = caches
    assert fast.length == ref.length == 9
    torch.testing.assert_close(fast.k[:, :, :9], ref.k[:, :, :9], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(fast.v[:, :, :9], ref.v[:, :, :9], rtol=1e-5, atol=2e-5)
    assert fast.k[:, :, :9].abs().sum() > 0 and not torch.equal(fast.k[:, :, 5:9], fast.k[:, :, :4])


def test_a_bf16_valued_target_streams_bf16_and_is_row_invariant_on_one_thread():
    """A float32 target whose weights are bfloat16 values (a bf16 checkpoint run in fp32) gets bf16 copies, which
    take the row kernel for one row too: a 1-row step equals the chain's row bit for bit even on one thread, and
    the pass still matches the eager layers."""
    target = random_target("llama", seed=8, init_scale=0.25, fused=False)
    with torch.no_grad():
        for p in target.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    target.model.fuse()
    cache = prefilled(target)
    past, n = cache.length, 4
    tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(6))
    fast, ref, _, _ = both_paths(target, cache, tokens, Visibility.causal(past, n, "cpu"))
    torch.testing.assert_close(fast.logits, ref.logits, rtol=1e-5, atol=2e-5)
    assert_steps_equal_chain(target, cache, tokens, threads=1)  # the LM head as bf16 too (tied: the embedding)
    assert target.head.compact is not None and random_target("llama", seed=8).head.compact is None


def test_copies_follow_weights_written_in_place():
    """The stack's packed copies and the 1-row transposes are re-made when a weight changes in place after
    loading (fuse()), so 1-row steps and verifies compute the current model: the same as a target fused after
    the change."""
    def edit(target):
        with torch.no_grad():
            for layer in target.model.model.layers:
                layer.mlp.down_proj.weight.mul_(0.5)  # K = 128: its packed copy is a copy
                layer.mlp.gate_proj.weight.add_(0.01)  # its 1-row transpose is a copy
    late = random_target("llama", seed=8, init_scale=0.25)
    edit(late)
    early = random_target("llama", seed=8, init_scale=0.25, fused=False)
    edit(early)
    early.model.fuse()
    caches = [prefilled(t) for t in (late, early)]
    for n, vis in ((1, Visibility(caches[0].length, None)), (5, tree_visibility(caches[0].length, 5))):
        tokens = torch.randint(0, late.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        positions = torch.arange(caches[0].length, caches[0].length + n)
        a, b = (t(tokens, positions, c, vis) for t, c in zip((late, early), caches))
        assert torch.equal(a.logits, b.logits), n


@pytest.mark.parametrize("native", [True, False], ids=["c++", "python"])
def test_weights_watch_sees_writes_repointing_and_replacement(native, monkeypatch):
    """WeightsWatch decides when the stacks' copies are re-made: it must see an in-place write, `p.data = x`, and a
    parameter replaced by attribute assignment, and nothing else (a false alarm only costs a rebuild; a miss would
    decode with stale copies). Its C++ snapshot and the Python fallback answer alike."""
    from ddtree.runtime.cpu import qlinear

    if native and not qlinear.cpu_kernel_available():
        pytest.skip("no CPU kernel on this machine")
    if not native:
        monkeypatch.setattr(qlinear, "cpu_kernel_available", lambda choice="auto": False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    watch = weights_watch.WeightsWatch(model.parameters)
    assert (watch.snapshot is not None) == native
    assert not watch.changed()
    torch.nn.Linear(3, 3)  # a registration elsewhere: a re-check of the identities, no alarm
    assert not watch.changed()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert watch.changed()
    watch.mark()
    model[1].bias.data = torch.zeros(4)
    assert watch.changed()
    watch.mark()
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().clone())
    assert watch.changed()
    watch.mark()
    model[0] = torch.nn.Linear(8, 8)
    assert watch.changed()
    watch.mark()
    assert not watch.changed()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["data", "numpy"])
def test_writes_torch_does_not_count_are_refused_until_refresh(how):
    """`w.data.mul_()` and a numpy view's elements bypass torch's write counters, so the copies the fast paths
    decode from kept the old weights (a different model, with every method agreeing with it). generate() refuses
    to decode then, naming pair.refresh(); after it, the tokens are those of the same edit made by a torch op."""
    from ddtree.api import Pair
    from ddtree.base.config import ConfigError

    def edit(pair, way):
        weights = [pair.target.model.model.layers[0].mlp.down_proj.weight, pair.drafter.model.layers[0].mlp.gate_proj.weight]
        for w in weights:
            if way == "torch":
                with torch.no_grad():
                    w.mul_(0.5)
            elif way == "data":
                w.data.mul_(0.5)
            else:
                w.detach().numpy()[:] *= 0.5

    def pair():
        target, drafter = random_pair("llama", seed=4, num_draft_layers=2, block_size=8, init_scale=0.25)
        return Pair(target, drafter, None)

    followed, edited = pair(), pair()
    for p in (followed, edited):
        p.generate([1, 2, 3], method="ddtree:8", max_new_tokens=4)  # the copies (and the drafter's stack) exist
    edit(followed, "torch")
    edit(edited, how)
    for method in ("ar", "dflash", "ddtree:8"):
        with pytest.raises(ConfigError, match=r"through .data or a numpy view.*pair.refresh\(\)"):
            edited.generate([1, 2, 3], method=method, max_new_tokens=4)
    edited.refresh()
    for method in ("ar", "dflash", "ddtree:8"):
        expected = followed.generate([5, 6, 7, 8], method=method, max_new_tokens=12).token_ids
        assert edited.generate([5, 6, 7, 8], method=method, max_new_tokens=12).token_ids == expected, method


def test_compact_copies_by_activation_kind():
    """Float activations: exact 8-bit blocks where the values are such, else bf16 where they are bf16, else none. Int8
    activations: 4-bit blocks rounded as llama.cpp rounds them (not exact: that mode is not the float arithmetic)."""
    from ddtree.runtime.cpu import qlinear

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    rounded = qlinear.round_po2_q8(w)
    assert cpu_stack.compact_copy(w) is None and cpu_stack.storage(w) == "float32"
    assert cpu_stack.compact_copy(rounded).kind == "Q8_0" and cpu_stack.storage(rounded) == "q8"
    assert torch.equal(cpu_stack.compact_copy(w.bfloat16().float()), w.bfloat16())
    for weight in (w, rounded):
        four = cpu_stack.compact_copy(weight, int8=True)
        assert torch.equal(four.qs, qlinear.QWeight.quantize(weight, "Q4_1").qs)
        assert four.kind == "Q4_1" and four.int8 and not four.stream and cpu_stack.storage(weight, int8=True) == "q4"
        assert (four.dequantize() - weight).abs().max() < 0.1 * weight.abs().max()
    narrow = rounded[:, :96]  # the int8 kernel needs K % 64 == 0: no 4-bit copy
    assert cpu_stack.compact_copy(narrow, int8=True) is None and cpu_stack.storage(narrow, int8=True) == "float32"


@pytest.mark.parametrize("last_only", [False, True])
def test_a_prefill_wider_than_a_stack_pass_runs_as_consecutive_passes(last_only):
    """A causal pass of more than MAX_ROWS rows (a prompt's prefill) runs as stack passes of at most MAX_ROWS rows,
    each after the K/V of the ones before: the K/V and taps of those passes made one by one, bit for bit (the head
    picks its kernel by the rows it is given, so the logits agree up to rounding), and the eager reference layers'
    values up to float32 rounding."""
    target = random_target("qwen3", seed=9, init_scale=0.25)
    n, width, taps = 2 * cpu_stack.MAX_ROWS + 5, cpu_stack.MAX_ROWS, (0, 2)
    tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(4))
    cache = target.new_cache(n + 4)
    out = target(tokens, torch.arange(n), cache, Visibility.causal(0, n, tokens.device), taps, last_only=last_only)
    parts, logits, features = target.new_cache(n + 4), [], []
    for start in range(0, n, width):
        stop = min(n, start + width)
        part = target(tokens[start:stop], torch.arange(start, stop), parts,
                      Visibility.causal(start, stop - start, tokens.device), taps)
        parts.commit(stop - start)
        logits.append(part.logits)
        features.append(part.taps)
    logits = torch.cat(logits)
    torch.testing.assert_close(out.logits, logits[-1:] if last_only else logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.taps, torch.cat(features)) and out.taps.shape[0] == n
    assert torch.equal(cache.k[:, :, :n], parts.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], parts.v[:, :, :n])
    eager = target.new_cache(n + 4)
    with torch.inference_mode():
        hidden, eager_taps = target.model.hidden_states(tokens, torch.arange(n), eager,
                                                        Visibility.causal(0, n, tokens.device), taps, last_only)
        torch.testing.assert_close(out.logits, target.logits(hidden), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.taps, eager_taps, rtol=1e-4, atol=1e-4)


def test_a_wide_drafter_context_runs_as_stack_passes_with_the_bits_of_narrow_ones():
    """A context wider than a stack pass (a prompt's) goes through the stack in parts of at most MAX_ROWS rows: each
    row's K/V depend on that row alone, so they equal those of the same rows queued a few at a time, bit for bit, and
    the eager ops' within float32 rounding."""
    target, drafter = random_pair("llama", seed=3, num_draft_layers=2, init_scale=0.25)
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    n = 2 * cpu_stack.MAX_ROWS + 5
    features = torch.randn(n, width, generator=torch.Generator().manual_seed(4))
    calls = []
    drafter.stack = _CountingContext(drafter.stack, calls)
    wide, narrow = drafter.new_cache(n + 8), drafter.new_cache(n + 8)
    drafter.add_context(wide, features)
    drafter.flush_context(wide)
    assert calls == [cpu_stack.MAX_ROWS, cpu_stack.MAX_ROWS, 5]
    for start in range(0, n, 7):
        drafter.add_context(narrow, features[start:start + 7])
        drafter.flush_context(narrow)
    assert wide.length == narrow.length == n
    assert torch.equal(wide.k[:, :, :n], narrow.k[:, :, :n]) and torch.equal(wide.v[:, :, :n], narrow.v[:, :, :n])
    drafter.context = False  # the eager ops
    eager = drafter.new_cache(n + 8)
    drafter.add_context(eager, features)
    drafter.flush_context(eager)
    torch.testing.assert_close(wide.k[:, :, :n], eager.k[:, :, :n], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(wide.v[:, :, :n], eager.v[:, :, :n], rtol=1e-5, atol=2e-5)


class _CountingContext:
    """Stands in for a drafter's stack where only its context() is called: records each call's row count, then
    passes the call on to the stack."""

    def __init__(self, stack, calls):
        self.stack, self.calls = stack, calls

    def context(self, features, *args):
        self.calls.append(features.shape[0])
        return self.stack.context(features, *args)
