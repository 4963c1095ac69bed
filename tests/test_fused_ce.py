"""The fused LM-head cross-entropy (ddtree/train/fused_ce.py) against the unfused one."""
import pytest
import torch

from ddtree.train.fused_ce import head_cross_entropy

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", [1.0, 60.0], ids=["trained-like", "untrained-wide-logits"])
def test_head_cross_entropy_matches_unfused(dtype, spread):
    """The chunked LM-head CE gives F.cross_entropy's values, top-1 hits and input gradient, across chunk
    boundaries (chunk 7 does not divide 50 rows), also when logits span hundreds (the exp floor)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 16, generator=gen) * spread / 4).to(dtype)
    hidden = torch.randn(50, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 300, (50,), generator=gen)
    labels[:5] = ((hidden[:5].detach().to(dtype) @ weight.T).float().argmax(-1))  # some rows hit
    row_w = torch.rand(50, generator=gen)
    ce, hit = head_cross_entropy(hidden, weight, labels, chunk=7)
    (ce * row_w).sum().backward()
    fused_grad, hidden.grad = hidden.grad.clone(), None
    logits = (hidden.to(dtype) @ weight.T).float()
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    (ref * row_w).sum().backward()
    assert ce.dtype == torch.float32 and hit.dtype == torch.bool
    torch.testing.assert_close(ce, ref.detach(), rtol=1e-5, atol=1e-4)
    assert hit.tolist() == (logits.argmax(-1) == labels).tolist() and hit[:5].all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the softmax is rounded to bf16 before @ weight
    torch.testing.assert_close(fused_grad, hidden.grad, rtol=tol, atol=tol * fused_grad.abs().max().item())
    assert fused_grad.abs().max() > 1e-3
