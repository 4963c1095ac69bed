"""loading.default_dtype: which dtype a device gets when the user names none."""
import pytest
import torch

from ddtree.loading import default_dtype


@pytest.mark.parametrize("amx, avx512_bf16, expected", [
    (True, True, torch.bfloat16),     # Sapphire Rapids-class Xeon: AMX tiles
    (False, True, torch.float32),     # Zen 4 EPYC: AVX512-BF16 without AMX, fp32 measured 2.8-3.4x faster
    (False, False, torch.float32),    # AVX2 only: bf16 emulated
])
def test_cpu_default_dtype_follows_amx_only(monkeypatch, amx, avx512_bf16, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert default_dtype(torch.device("cpu")) is expected


def test_cuda_default_dtype_is_bf16():
    assert default_dtype(torch.device("cuda")) is torch.bfloat16
