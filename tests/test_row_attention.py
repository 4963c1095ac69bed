"""The generator's Triton decode attention (kernels/row_attention.py) against its SDPA reference (CPU: the Triton
interpreter; CUDA: the compiled kernel)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

triton = pytest.importorskip("triton")

from ddtree.base.kernel_files import kernel_module  # noqa: E402

ra = kernel_module("row_attention")
if not torch.cuda.is_available() and not ra._interpreting():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1",
                allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32)])
def test_row_attention_equals_sdpa_over_each_rows_keys(dtype, tol, hq, hkv, d):
    torch.manual_seed(0)
    rows, t = 6, 200
    q = torch.randn(rows, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(rows, hkv, t, d, device=DEVICE, dtype=dtype)
    v = torch.randn(rows, hkv, t, d, device=DEVICE, dtype=dtype)
    lengths = torch.tensor([1, 64, 65, 130, 199, 200], device=DEVICE)  # one key, block edges, the whole cache
    k[0, :, 1:] = 1e4  # keys past a row's length must not be read
    out = ra.row_attention(q, k, v, lengths)
    ref = ra.row_attention_reference(q.float(), k.float(), v.float(), lengths)
    assert (out.float() - ref).abs().max().item() < tol


def test_row_attention_reads_strided_queries_and_writes_into_out():
    torch.manual_seed(1)
    q = torch.randn(3, 4, 6, 32, device=DEVICE)[:, :, 0]  # [R, Hq, D] with a row stride of 4 * 6 * 32
    k, v = torch.randn(2, 3, 2, 50, 32, device=DEVICE).unbind(0)
    lengths = torch.tensor([50, 7, 20], device=DEVICE, dtype=torch.int32)
    out = torch.empty(3, 4, 32, device=DEVICE)
    assert ra.row_attention(q, k, v, lengths, out=out) is out
    assert torch.allclose(out, ra.row_attention_reference(q, k, v, lengths), atol=1e-5)


def test_bad_shapes_are_refused():
    q, k = torch.zeros(2, 9, 64, device=DEVICE), torch.zeros(2, 3, 10, 64, device=DEVICE)
    with pytest.raises(ValueError, match="lengths"):
        ra.row_attention(q, k, k, torch.ones(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="head groups"):
        ra.row_attention(torch.zeros(2, 8, 64, device=DEVICE), k, k, torch.ones(2, dtype=torch.int64, device=DEVICE))
