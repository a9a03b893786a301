"""The chunked Mamba2 SSD scan (`_ssd_chunked`) against the one-token recurrence, and its
segment sums against the masked cumulative sum transformers builds them with."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid_pd.engine.models.mamba2 import _EXP_ZERO, _ssd_chunked, _ssd_step


def _inputs(length: int, heads=4, hd=8, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, hd, generator=g)
    dt = F.softplus(torch.randn(length, heads, generator=g) * 3 - 2)  # 1e-4 .. ~10
    a_coef = -torch.exp(torch.rand(heads, generator=g) * 4 - 2)
    b = torch.randn(length, heads, n, generator=g)
    c = torch.randn(length, heads, n, generator=g)
    h0 = torch.randn(heads, hd, n, generator=g)
    return x, dt, a_coef, b, c, h0


@pytest.mark.parametrize(("length", "chunk", "offset"), [(40, 16, 0), (37, 16, 5), (3, 8, 6)])
def test_chunked_matches_recurrence(length, chunk, offset):
    x, dt, a_coef, b, c, h0 = _inputs(length)
    y, state = _ssd_chunked(x, dt, a_coef, b, c, chunk, h0, offset)
    ys, s = [], h0
    for t in range(length):
        out, s = _ssd_step(x[t], dt[t], a_coef, b[t], c[t], s)
        ys.append(out)
    torch.testing.assert_close(y, torch.stack(ys), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, s, rtol=1e-4, atol=1e-4)


def _decay_by_masked_cumsum(log_a: torch.Tensor) -> torch.Tensor:
    """transformers' segment sum: log_a [Q, H] -> exp(seg) [H, Q(l), Q(s)]."""
    q = log_a.shape[0]
    x = log_a.t()[..., None].expand(-1, -1, q)  # [H, Q(k), Q(s)]
    x = x.masked_fill(~torch.ones(q, q, dtype=torch.bool).tril(-1), 0)
    seg = x.cumsum(dim=-2)
    return torch.exp(seg.masked_fill(~torch.ones(q, q, dtype=torch.bool).tril(), -math.inf))


def test_segment_sums_match_masked_cumsum():
    # one chunk, h0 = 0, b = c = 1, x * dt one-hot at s: y[l] = decay[l, s], so the scan's
    # decays can be read off its output (to the rounding of x * dt = 1)
    q, heads = 32, 3
    _, dt, a_coef, _, _, _ = _inputs(q, heads=heads, hd=1, n=1, seed=1)
    expected = _decay_by_masked_cumsum(dt * a_coef)  # [H, l, s]
    ones, h0 = torch.ones(q, heads, 1), torch.zeros(heads, 1, 1)
    for s in range(q):
        x = torch.zeros(q, heads, 1)
        x[s] = 1.0 / dt[s, :, None]
        y, _ = _ssd_chunked(x, dt, a_coef, ones, ones, q, h0, 0)
        torch.testing.assert_close(y[s:, :, 0].t(), expected[:, s:, s], rtol=1e-6, atol=0)


def test_exp_zero_bound():
    # the scan writes 0 instead of exp(x) for x < _EXP_ZERO: exp must round to 0 there
    x = torch.tensor([_EXP_ZERO, _EXP_ZERO - 1e-3, _EXP_ZERO - 50.0, -math.inf])
    assert torch.equal(torch.exp(x), torch.zeros(4))
    assert torch.exp(torch.tensor(_EXP_ZERO + 1.0)) > 0  # and the bound is not far too low
