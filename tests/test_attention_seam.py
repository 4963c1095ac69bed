"""The attention seam: the Triton kernel (interpreted on the CPU) serves the engine like SDPA does."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from conftest import plant_oracle, run  # noqa: E402
from ddtree.attention import Visibility, attend, resolve_backend  # noqa: E402
from ddtree.testing import random_pair  # noqa: E402

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)


def test_backend_selection(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setenv("DDTREE_ATTENTION", "sdpa")
    assert resolve_backend("triton", torch.device("cpu")) == "sdpa"
    monkeypatch.setenv("DDTREE_ATTENTION", "flash9")
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("auto", torch.device("cpu"))


@pytest.mark.parametrize("ancestors", ["tree", "none"])
def test_seam_backends_agree(ancestors):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((8, 5, 16), (2, 12, 16), (2, 12, 16)))
    anc = None
    if ancestors == "tree":
        anc = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                           dtype=torch.bool)
    a = attend(q, k, v, Visibility(7, anc), "sdpa")
    b = attend(q, k, v, Visibility(7, anc), "triton")
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_engine_with_triton_backend_is_lossless():
    target, drafter = random_pair("qwen3", seed=12, block_size=4, num_layers=2, num_draft_layers=1)
    prompt = [3, 9, 27, 81 % 96, 5]
    reference, _ = run(target, None, prompt, "ar", max_new_tokens=10)
    plant_oracle(drafter, prompt + reference + [0] * 50, seed=0, top1=0.7)
    target.attention_backend = drafter.attention_backend = "triton"
    for method, budget in [("dflash", 1), ("ddtree", 6)]:
        tokens, stats = run(target, drafter, prompt, method, budget, max_new_tokens=10)
        assert tokens == reference and stats.attention_backend == "triton"
