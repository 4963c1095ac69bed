"""The attention seam: the Triton kernel (interpreted on the CPU) serves the engine like SDPA does."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from conftest import plant_oracle, run  # noqa: E402
from ddtree.base.config import ConfigError  # noqa: E402
from ddtree.models.attention import Visibility, attend, resolve_backend  # noqa: E402
from ddtree.bench.testing import random_pair  # noqa: E402

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel natively, else in the interpreter


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # conftest sets it only without a GPU; selection is read per call
    assert resolve_backend("auto", cpu) == "sdpa"
    assert resolve_backend("triton", cpu) == "triton"  # the interpreter runs it
    from ddtree.base.options import LoadOptions

    monkeypatch.setenv("DDTREE_ATTENTION", "triton")  # read by load() only (options.py), into the name
    assert resolve_backend("auto", cpu) == "sdpa"
    assert resolve_backend(LoadOptions.resolve().attention, cpu) == "triton"  # the environment fills in 'auto' ...
    assert resolve_backend(LoadOptions.resolve(attention="sdpa").attention, cpu) == "sdpa"  # ... not a choice
    monkeypatch.setenv("DDTREE_ATTENTION", "flash9")
    with pytest.raises(ConfigError, match="DDTREE_ATTENTION='flash9' is not valid: use one of auto, sdpa, triton"):
        LoadOptions.resolve()
    monkeypatch.setenv("DDTREE_ATTENTION", "")  # empty is unset
    assert resolve_backend(LoadOptions.resolve().attention, cpu) == "sdpa"
    monkeypatch.setenv("DDTREE_ATTENTION", "SDPA")  # the knobs' rules: any case
    assert resolve_backend(LoadOptions.resolve().attention, cpu) == "sdpa"


def test_triton_where_it_cannot_run_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # unset already on a machine with a GPU
    with pytest.raises(ConfigError, match="'triton' cannot run here: it needs a CUDA GPU"):
        resolve_backend("triton", torch.device("cpu"))
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"


@pytest.mark.slow
def test_backend_resolved_once_at_load(monkeypatch, tmp_path):
    """The environment is read when the model is loaded, never on a forward pass."""
    import json

    from safetensors.torch import save_file

    from ddtree.models.loading import load_target

    target, _ = random_pair("llama", seed=2)
    (tmp_path / "config.json").write_text(json.dumps(target.cfg.to_hf()))
    save_file({k: v.contiguous() for k, v in target.model.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    from ddtree.base.options import LoadOptions

    monkeypatch.setenv("DDTREE_ATTENTION", "triton")
    loaded = load_target(tmp_path, torch.float32, DEVICE, LoadOptions.resolve().attention)  # as load() does
    assert loaded.attention_backend == "triton"
    monkeypatch.setenv("DDTREE_ATTENTION", "flash9")  # read on a pass, this would raise
    ids = torch.tensor([1, 2, 3], device=DEVICE)
    loaded(ids, torch.arange(3, device=DEVICE), loaded.new_cache(3), Visibility.causal(0, 3, DEVICE))
    assert loaded.attention_backend == "triton"
    with pytest.raises(ValueError, match="not a resolved one"):
        attend(torch.zeros(4, 1, 16), torch.zeros(2, 1, 16), torch.zeros(2, 1, 16), Visibility(0, None), "auto")


@pytest.mark.parametrize("ancestors", ["tree", "none"])
def test_seam_backends_agree(ancestors):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g).to(DEVICE) for s in ((8, 5, 16), (2, 12, 16), (2, 12, 16)))
    anc = None
    if ancestors == "tree":
        anc = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                           dtype=torch.bool, device=DEVICE)
    a = attend(q, k, v, Visibility(7, anc), "sdpa")
    b = attend(q, k, v, Visibility(7, anc), "triton")
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_engine_with_triton_backend_is_lossless():
    target, drafter = random_pair("qwen3", seed=12, block_size=4, num_layers=2, num_draft_layers=1, device=DEVICE)
    prompt = [3, 9, 27, 81 % 96, 5]
    reference, _ = run(target, None, prompt, "ar", max_new_tokens=10)
    plant_oracle(drafter, prompt + reference + [0] * 50, seed=0, top1=0.7)
    target.model.attention_backend = drafter.model.attention_backend = "triton"
    for method, budget in [("dflash", 1), ("ddtree", 6)]:
        tokens, stats = run(target, drafter, prompt, method, budget, max_new_tokens=10)
        assert tokens == reference and stats.attention_backend == "triton"


def test_a_prefill_runs_sdpas_causal_kernel_and_later_chains_the_tree_kernel(monkeypatch):
    """A causal pass from position 0 (a prompt's prefill) goes to SDPA's causal kernel under the Triton backend (GEMM
    speed, no dense bit mask); a causal chain after a past (a verify) still goes to the tree kernel."""
    from ddtree.base.kernel_files import kernel_module

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, generator=g).to(DEVICE) for s in ((8, 40, 16), (2, 40, 16), (2, 40, 16)))
    ta = kernel_module("tree_attention")
    calls = []
    real = ta.tree_attention
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prefill = attend(q, k, v, Visibility.causal(0, 40, DEVICE), "triton")
    assert not calls
    torch.testing.assert_close(prefill, attend(q, k, v, Visibility.causal(0, 40, DEVICE), "sdpa"), rtol=1e-5, atol=1e-5)
    chain = attend(q[:, 30:], k, v, Visibility.causal(30, 10, DEVICE), "triton")
    assert calls
    torch.testing.assert_close(chain, prefill[:, 30:], rtol=1e-4, atol=1e-4)
