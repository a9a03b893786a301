"""RMSNorm's float32 path: PyTorch's (one `F.rms_norm` call) gives the same bits as the
formula; the C kernel's (`cpu_kernels.rms_norm`, the path on the CPU) the same values within
float32 rounding (its sum of squares runs in another order)."""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.models.common import RMSNorm


@pytest.mark.parametrize(("offset", "after_cast"), [(0.0, False), (1.0, False), (0.0, True)])
@pytest.mark.parametrize("shape", [(300, 64), (7, 5, 64)])
def test_float32_path_is_bit_identical(offset, after_cast, shape, monkeypatch):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6, offset, after_cast)
    norm.weight.data = torch.randn(64, generator=g)
    x = torch.randn(*shape, generator=g) * 3
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (offset + norm.weight) * xf if after_cast else xf * (offset + norm.weight)
    with torch.no_grad():
        fused = norm(x)
        assert (fused - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()
        monkeypatch.setattr(cpu_kernels, "rms_norm", lambda *a, **k: None)
        assert torch.equal(norm(x), expected)
