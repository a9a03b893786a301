"""The chunked Mamba2 SSD scan (`_ssd_chunked`) against the one-token recurrence, and its
segment sums against the masked cumulative sum transformers builds them with."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid_pd.engine.models.common import EXP_ZERO, exp_or_zero
from hybrid_pd.engine.models.mamba2 import _ssd_chunked, _ssd_step
from hybrid_pd.engine.threads import flush_denormals


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
    ys, s = [], h0[None]
    for t in range(length):
        out, s = _ssd_step(x[t, None], dt[t, None], a_coef, b[t, None], c[t, None], s)
        ys.append(out[0])
    s = s[0]
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
    # exp_or_zero writes 0 instead of exp(x) for x < EXP_ZERO: exp must round to 0 there even
    # where subnormal results are kept (engine processes flush them, and this one does too)
    assert torch.set_flush_denormal(False)
    try:
        x = torch.tensor([EXP_ZERO, EXP_ZERO - 1e-3, EXP_ZERO - 50.0, -math.inf])
        assert torch.equal(torch.exp(x), torch.zeros(4))
        assert torch.exp(torch.tensor(EXP_ZERO + 1.0)) > 0  # and the bound is not far too low
    finally:
        flush_denormals()


def test_exp_or_zero_gives_exps_own_values():
    # normal, denormal, zero and -inf results, and NaN, all as exp gives them
    x = torch.cat([torch.linspace(-120.0, 5.0, 4001), torch.tensor([-math.inf, math.nan])])
    got = exp_or_zero(x.clone())
    assert torch.equal(got.nan_to_num(), torch.exp(x).nan_to_num()) and got[-1].isnan()
    # a tensor floor broadcasts; +inf masks entries out whatever their value
    seg = torch.randn(3, 4, 4) * 50 - 60
    floor = torch.full((4, 4), EXP_ZERO).masked_fill_(~torch.ones(4, 4).tril().bool(), math.inf)
    want = torch.exp(seg).tril()
    assert torch.equal(exp_or_zero(seg.clone(), floor), want)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_step_on_strided_rows_matches_the_per_head_formula(groups):
    """_ssd_step on states gathered as pool rows (a row stride wider than a state), with B
    and C per group, updated in place: h' = exp(dt A) h + dt x B^T, y = h' C, per head."""
    seqs, heads, hd, n = 3, 4, 8, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(seqs, heads, hd, generator=g)
    dt = F.softplus(torch.randn(seqs, heads, generator=g))
    a_coef = -torch.exp(torch.rand(heads, generator=g))
    b = torch.randn(seqs, groups, n, generator=g)
    c = torch.randn(seqs, groups, n, generator=g)
    rows = torch.randn(seqs, heads * hd * n + 40, generator=g)
    h0 = rows[:, 24 : 24 + heads * hd * n].unflatten(1, (heads, hd, n))
    per = heads // groups
    bh, ch = b.repeat_interleave(per, dim=1), c.repeat_interleave(per, dim=1)
    want = (
        torch.exp(dt * a_coef)[..., None, None] * h0
        + (dt[..., None] * x)[..., None] * bh[:, :, None, :]
    )
    want_y = (want * ch[:, :, None, :]).sum(-1)
    before = rows.clone()
    y, state = _ssd_step(x, dt, a_coef, b, c, h0, in_place=True)
    assert state.data_ptr() == h0.data_ptr()  # updated where it lies
    torch.testing.assert_close(state, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    assert torch.equal(rows[:, :24], before[:, :24]) and torch.equal(rows[:, -16:], before[:, -16:])
