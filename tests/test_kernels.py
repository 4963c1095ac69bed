"""Triton tree attention vs its PyTorch reference (CPU: the Triton interpreter; CUDA: the compiled kernel)."""
from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

triton = pytest.importorskip("triton")

from ddtree.base.kernel_files import kernel_dir, kernel_module  # noqa: E402

ta = kernel_module("tree_attention")  # from kernels/, wherever ddtree runs from (ddtree/base/kernel_files.py)

if not torch.cuda.is_available() and not type(ta._tree_attention_kernel).__name__.startswith("Interpreted"):
    # Triton picks interpreter mode when it is imported (triton.language too); it cannot be switched later.
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1",
                allow_module_level=True)

TreeAttentionConfig = ta.TreeAttentionConfig
pack_ancestor_bits, unpack_ancestor_bits = ta.pack_ancestor_bits, ta.unpack_ancestor_bits
tree_attention, tree_attention_reference = ta.tree_attention, ta.tree_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The interpreter runs tl.dot through numpy; torch's spinning OpenMP workers slow it down ~3x on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_parents(n: int, kind: str, gen: torch.Generator) -> list[int]:
    """parents[0] = -1; parents[i] < i (parents precede children)."""
    parents = [-1]
    for i in range(1, n):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(0)
        elif kind == "deep":  # long branches that occasionally fork from an earlier node
            fork = torch.rand((), generator=gen) < 0.15
            parents.append(int(torch.randint(0, i, (), generator=gen)) if fork else i - 1)
        else:  # "bushy": random recursive tree
            parents.append(int(torch.randint(0, i, (), generator=gen)))
    return parents


def ancestor_matrix(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """bool [N, N]; kind 'full' is the drafter's all-visible block (not a tree, not lower-triangular)."""
    if kind == "full":
        return torch.ones(n, n, dtype=torch.bool)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(random_parents(n, kind, gen)):
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def make_inputs(dtype, hq, hkv, d, past, n, seed, layout="head_major"):
    """q [Hq, N, D] (a transposed view of [N, Hq, D]); k, v [Hkv, past + N, D] as views of a bigger cache
    whose rows beyond past + N are poisoned, so reading them would show up in the output."""
    gen = torch.Generator().manual_seed(seed)
    cap = past + n + 7
    q = torch.randn(n, hq, d, generator=gen).to(dtype).transpose(0, 1)

    def cache():
        if layout == "head_major":  # [Hkv, T_cap, D]
            buf = torch.randn(hkv, cap, d, generator=gen).to(dtype)
            buf[:, past + n:] = float("nan")
            view = buf[:, : past + n + 3]  # T > past + N: the kernel must stop at past + N
        else:  # token-major [T_cap, Hkv, D] -> [Hkv, T, D] view with stride_t = Hkv * D
            buf = torch.randn(cap, hkv, d, generator=gen).to(dtype)
            buf[past + n:] = float("inf")
            view = buf.transpose(0, 1)
        return view.to(DEVICE)

    return q.to(DEVICE), cache(), cache()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(dtype, hq, hkv, d, past, n, tree, config=None, seed=0, causal_tree=False, layout="head_major",
          scale=None):
    q, k, v = make_inputs(dtype, hq, hkv, d, past, n, seed, layout)
    anc = ancestor_matrix(n, tree, torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    bits = pack_ancestor_bits(anc)
    out = torch.full((hq, n, d), float("nan"), dtype=dtype, device=DEVICE)  # unwritten elements fail
    res = tree_attention(q, k, v, past, bits, scale, out=out, config=config, causal_tree=causal_tree)
    assert res is out and res.dtype == dtype and res.shape == (hq, n, d)
    ref = tree_attention_reference(q.float(), k.float(), v.float(), past, anc, scale)  # fp32 all the way
    assert torch.isfinite(res).all()
    err = rel_err(res, ref)
    assert err < TOL[dtype], f"relative error {err:.3g}"
    return res


B = TreeAttentionConfig
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (dtype, Hq, Hkv, D, past, N, tree, config); None = select_config's choice. A representative grid, not the
# full product: every past (0, 1, 37, 600), N (1, 2, 15, 64, 300), tree kind, GQA ratio and head dim shows up.
CASES = [
    (F32, 8, 8, 64, 0, 1, "chain", None),  # plain decoding, no past
    (F32, 8, 4, 128, 1, 2, "chain", None),
    (F16, 8, 2, 64, 37, 15, "bushy", None),
    (BF16, 8, 1, 128, 600, 1, "chain", None),  # decode, GQA 8, long past
    (BF16, 4, 2, 64, 0, 64, "star", None),
    (F16, 8, 1, 64, 37, 64, "deep", None),
    (F32, 4, 1, 128, 600, 15, "bushy", None),
    (BF16, 2, 1, 64, 1, 300, "bushy", None),
    (F16, 1, 1, 128, 0, 300, "chain", None),  # linear (DFlash) verify without past
    (F32, 2, 2, 64, 600, 300, "deep", None),
    (BF16, 8, 2, 128, 37, 2, "full", None),  # drafter block: every new row sees every new row
    (BF16, 8, 1, 128, 600, 64, "bushy", None),
    (F16, 8, 4, 128, 37, 300, "deep", None),
    (F16, 4, 4, 64, 1, 16, "full", None),
    # small tiles: many key blocks, partial blocks, tiles that straddle nodes of several heads
    (F32, 8, 2, 64, 37, 64, "bushy", B(16, 32)),
    (F16, 4, 1, 128, 600, 15, "deep", B(32, 64)),
    (BF16, 8, 8, 64, 1, 33, "star", B(16, 32)),
    (F32, 2, 1, 64, 0, 100, "chain", B(64, 32)),
    # split-K (flash decoding) over the past
    (BF16, 8, 2, 128, 600, 1, "chain", B(16, 64, num_splits=4)),
    (F16, 8, 1, 64, 600, 15, "bushy", B(64, 64, num_splits=7)),  # uneven: 10 past blocks over 5 splits
    (F32, 4, 4, 64, 37, 64, "deep", B(16, 32, num_splits=3)),
    (F32, 4, 2, 64, 0, 15, "chain", B(16, 32, num_splits=4)),  # no past: falls back to one split
    (BF16, 2, 1, 64, 600, 300, "star", B(64, 64, num_splits=3)),
]


def case_id(case) -> str:
    dtype, hq, hkv, d, past, n, tree, cfg = case
    tiles = "auto" if cfg is None else f"m{cfg.block_m}n{cfg.block_n}s{cfg.num_splits}"
    return f"{str(dtype)[6:]}-g{hq // hkv}-d{d}-p{past}-n{n}-{tree}-{tiles}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype,hq,hkv,d,past,n,tree,config", CASES, ids=[case_id(c) for c in CASES])
def test_kernel_matches_reference(dtype, hq, hkv, d, past, n, tree, config):
    seed = zlib.crc32(repr((dtype, hq, hkv, d, past, n, tree)).encode())  # fresh inputs per case, stable
    check(dtype, hq, hkv, d, past, n, tree, config, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("config", [None, B(16, 32), B(16, 32, num_splits=2)])
def test_causal_tree_skip_matches(config):
    """causal_tree=True (skip tree blocks after the tile's last node) gives the same result on real trees."""
    a = check(F32, 4, 2, 64, 37, 100, "bushy", config, seed=5, causal_tree=False)
    b = check(F32, 4, 2, 64, 37, 100, "bushy", config, seed=5, causal_tree=True)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", [B(16, 32), B(16, 32, num_splits=3), B(16, 32, num_splits=9)])
def test_past_length_read_on_the_device(config):
    """A device past_len (what a captured CUDA graph passes): the same output as the int for any past that fits,
    with the split count fixed for the longest past (T - N), so splits past the end get no block and weigh 0;
    with one split it is the same arithmetic, so the same bits. The rows beyond past + N are poisoned."""
    n, cap = 11, 100
    q, k, v = make_inputs(F32, 4, 2, 32, cap - n, n, seed=9)
    anc = ancestor_matrix(n, "bushy", torch.Generator().manual_seed(3)).to(DEVICE)
    bits = pack_ancestor_bits(anc)
    for past in (0, 5, 40, cap - n):
        kp, vp = k.clone(), v.clone()  # node j's K/V at row past + j, the rows after it poisoned
        kp[:, past:past + n], vp[:, past:past + n] = k[:, cap - n:cap], v[:, cap - n:cap]
        kp[:, past + n:], vp[:, past + n:] = float("nan"), float("nan")
        on_host = ta.tree_attention(q, kp, vp, past, bits, config=config, causal_tree=True)
        dev_past = torch.tensor([past], dtype=torch.int32, device=DEVICE)
        on_device = ta.tree_attention(q, kp, vp, dev_past, bits, config=config, causal_tree=True)
        assert torch.isfinite(on_device).all(), past
        if config.num_splits == 1:
            assert torch.equal(on_device, on_host), past
        torch.testing.assert_close(on_device, ta.tree_attention_reference(q, kp, vp, past, anc), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="one int32"):
        ta.tree_attention(q, k, v, torch.tensor([1], device=DEVICE), bits)


def test_token_major_cache_and_custom_scale():
    check(F16, 4, 2, 64, 37, 15, "bushy", seed=3, layout="token_major", scale=0.3)
    check(F32, 4, 1, 32, 5, 9, "deep", B(16, 32), seed=4, layout="token_major")  # head_dim 32


def test_non_power_of_two_head_dim():
    check(F32, 2, 1, 80, 37, 15, "bushy", seed=6)  # padded to BLOCK_D = 128 and masked


def test_padding_bits_are_ignored():
    """Bits at positions >= N (garbage in the last word) must not make phantom keys visible."""
    q, k, v = make_inputs(F32, 2, 1, 64, 5, 40, seed=7)
    anc = ancestor_matrix(40, "bushy", torch.Generator().manual_seed(7)).to(DEVICE)
    bits = pack_ancestor_bits(anc)
    dirty = bits.clone()
    dirty[:, -1] |= torch.tensor(-256, dtype=torch.int32)  # bits 8..31 of word 1 = nodes 40..63
    out = tree_attention(q, k, v, 5, dirty, config=B(16, 32))
    assert rel_err(out, tree_attention_reference(q, k, v, 5, anc)) < TOL[F32]


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
def test_pack_ancestor_bits_round_trip(n):
    gen = torch.Generator().manual_seed(n)
    for anc in (ancestor_matrix(n, "bushy", gen), torch.rand(n, n, generator=gen) < 0.5):
        bits = pack_ancestor_bits(anc)
        assert bits.dtype == torch.int32 and bits.shape == (n, (n + 31) // 32)
        assert torch.equal(unpack_ancestor_bits(bits), anc)
        for i, j in [(0, 0), (n - 1, 0), (n - 1, n - 1), (n // 2, n // 3)]:  # the documented bit layout
            word = int(bits[i, j // 32]) & 0xFFFFFFFF
            assert bool((word >> (j % 32)) & 1) == bool(anc[i, j])


def test_reference_accepts_bits_or_bool():
    q, k, v = make_inputs(F32, 4, 2, 64, 3, 40, seed=8)
    anc = ancestor_matrix(40, "bushy", torch.Generator().manual_seed(8)).to(DEVICE)
    torch.testing.assert_close(tree_attention_reference(q, k, v, 3, anc),
                               tree_attention_reference(q, k, v, 3, pack_ancestor_bits(anc)))


def test_input_validation():
    q, k, v = make_inputs(F32, 4, 2, 64, 3, 5, seed=9)
    bits = pack_ancestor_bits(torch.ones(5, 5, dtype=torch.bool).tril().to(DEVICE))
    bad = [
        (lambda: tree_attention(q, k, v[:, :-1], 3, bits), "k and v shapes differ"),
        (lambda: tree_attention(q[..., :32], k, v, 3, bits), "head_dim mismatch"),
        (lambda: tree_attention(q[:3], k, v, 3, bits), "multiple of KV heads"),
        (lambda: tree_attention(q, k[:, :7], v[:, :7], 3, bits), "past_len \\+ N"),
        (lambda: tree_attention(q, k, v, 3, bits[:4]), "anc_bits must be int32"),
        (lambda: tree_attention(q, k, v, 3, bits.to(torch.int64)), "anc_bits must be int32"),
        (lambda: tree_attention(q, k, v.half(), 3, bits), "dtypes differ"),
        (lambda: tree_attention(q[0], k, v, 3, bits), "must be 3-D"),
        (lambda: tree_attention(q, k, v, -1, bits), "rows are needed"),
        (lambda: tree_attention(q, k, v, 3, bits, out=torch.empty(4, 5, 32, device=DEVICE)), "out must be"),
        (lambda: tree_attention(q, k, v, 3, bits, config=B(16, 48)), "multiple of 32"),
        (lambda: pack_ancestor_bits(torch.ones(3, 4, dtype=torch.bool)), "square"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.slow
def test_compiles_for_h100_without_gpu():
    """AOT-compile one H100 config (the interpreter never exercises the GPU lowering): no spills, fits smem."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no AOT compile API")
    res = subprocess.run([sys.executable, str(kernel_dir() / "compile_check.py"), "--quick"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


@needs_cuda
@pytest.mark.parametrize("past,n", [(0, 1), (4096, 1), (4096, 16), (1000, 64), (16384, 256), (37, 1024)])
def test_cuda_auto_config_bf16(past, n):
    """Benchmark-like shapes with select_config's H100 choices (split-K included) on the compiled kernel."""
    check(BF16, 32, 8, 128, past, n, "bushy", seed=past + n, causal_tree=True)
    check(F16, 16, 8, 64, past, n, "chain", seed=past + n + 1)


def test_select_config_fp32_tiles_are_the_compile_checked_ones(monkeypatch):
    """fp32 K/V tiles are twice as large: a 128-key block with 3 stages needed ~400 KB of shared memory and
    failed on an H100 (OutOfResources). The fp32 choices must be configs that compile_check.py compiles."""
    from types import SimpleNamespace

    CONFIGS = kernel_module("compile_check").CONFIGS

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    checked = {(c[0], c[2], c[3], c[4], c[5], c[6]) for c in CONFIGS}
    for group, d, n in ((2, 128, 2), (4, 128, 16), (8, 64, 16), (1, 256, 64)):
        cfg = ta.select_config(group * n, 0, d, 8, "cuda", elem_bytes=4)
        assert ("fp32", d, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) in checked, (group, d, n, cfg)
        bf16 = ta.select_config(group * n, 0, d, 8, "cuda")
        assert cfg.block_n <= bf16.block_n and cfg.num_stages <= bf16.num_stages


@needs_cuda
def test_cuda_select_config_splits_long_past():
    cfg = ta.select_config(4 * 16, 32768, 128, 8, "cuda")
    assert cfg.num_splits > 1 and cfg.block_n % 32 == 0
