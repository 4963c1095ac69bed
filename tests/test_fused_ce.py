"""The fused LM-head cross-entropy (ddtree/train/fused_ce.py) against the unfused one."""
import pytest
import torch

from ddtree.train.fused_ce import head_acceptance_loss, head_cross_entropy, merge_duplicate_ids

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


def test_head_acceptance_loss_matches_unfused():
    """The chunked total-variation loss 1 - sum min(p, q) gives the unfused value, top-1 hits and input gradient
    (autograd through an explicit softmax), with rows whose target has zero-weight columns and a row with no
    weight at all."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 16, generator=gen) / 2
    hidden = torch.randn(40, 16, generator=gen, requires_grad=True)
    idx = torch.stack([torch.randperm(200, generator=gen)[:6] for _ in range(40)])  # distinct ids per row
    w = torch.rand(40, 6, generator=gen) ** 3
    w[:, 4:] = 0  # padding columns
    w = w / w.sum(-1, keepdim=True)
    w[3] = 0  # a row whose label is outside the draft vocabulary and no teacher
    labels = idx[:, 0].clone()
    row_w = torch.rand(40, generator=gen)
    tv, hit = head_acceptance_loss(hidden, weight, idx, w, labels, chunk=7)
    (tv * row_w).sum().backward()
    fused_grad, hidden.grad = hidden.grad.clone(), None
    logits = hidden @ weight.T
    q = logits.softmax(-1).gather(1, idx)
    ref = w.sum(-1) - torch.minimum(q, w).sum(-1)
    (ref * row_w).sum().backward()
    torch.testing.assert_close(tv, ref.detach(), rtol=1e-5, atol=1e-6)
    assert tv[3] == 0 and (tv[torch.arange(40) != 3] > 0).all() and (tv <= 1).all()
    assert hit.tolist() == (logits.argmax(-1) == labels).tolist()
    torch.testing.assert_close(fused_grad, hidden.grad, rtol=1e-5, atol=1e-6)
    assert fused_grad.abs().max() > 1e-3 and not fused_grad[3].any()


def test_merge_duplicate_ids_keeps_one_total_per_id():
    idx = torch.tensor([[5, 5, 7, 2, 7], [1, 2, 3, 4, 1]])
    w = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.0, 0.25]])
    merged = merge_duplicate_ids(idx, w)
    torch.testing.assert_close(merged, torch.tensor([[0.7, 0.0, 0.2, 0.1, 0.0], [0.5, 0.25, 0.25, 0.0, 0.0]]))
