"""Decode-step kernels that update each sequence's state where it lies in a paged pool
(`rows`: block ids), against the same kernels on gathered copies: the same bits, and no
byte of the pool outside the rows' states changes."""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.models.gated_deltanet import _l2norm

pytestmark = pytest.mark.usefixtures("one_thread")  # the kernels build here (test_cpu_kernels)


def _pool(blocks: int, shape: tuple[int, ...], pad: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [blocks, page] float32 buffer of random bytes, its [blocks, *shape] view at an
    offset inside each page, as `KVPool.state_views` gives)."""
    n = 1
    for d in shape:
        n *= d
    buffer = torch.randn(blocks, n + 2 * pad, generator=gen)
    return buffer, buffer[:, pad : pad + n].unflatten(1, shape)


IDS = torch.tensor([6, 1, 4, 9, 3], dtype=torch.int64)  # any order, not contiguous


def _same_as_gathered(step, buffer: torch.Tensor, view: torch.Tensor) -> None:
    """`step(state, rows)` (a kernel call returning its output) on the pool's rows `IDS`
    where they lie gives the output and the states it gives on a gathered copy, and leaves
    every other block of the pool as it was."""
    gathered = view.index_select(0, IDS)
    start = gathered.clone()
    out_gathered = step(gathered, None)
    assert not torch.equal(gathered, start), "the step changed no state: it tests nothing"
    before = buffer.clone()
    out = step(view, IDS)
    assert torch.equal(out, out_gathered)
    assert torch.equal(view.index_select(0, IDS), gathered)
    others = [i for i in range(len(buffer)) if i not in IDS.tolist()]
    assert torch.equal(buffer[others], before[others])


@pytest.mark.parametrize(("heads", "hd", "ns", "groups"), [(6, 16, 128, 2), (4, 8, 24, 1)])
def test_ssd_step_in_the_pool_equals_the_step_on_gathered_rows(heads, hd, ns, groups):
    gen = torch.Generator().manual_seed(1)
    seqs = len(IDS)
    buffer, view = _pool(10, (heads, hd, ns), 5, gen)
    x = torch.randn(seqs, heads, hd, generator=gen)
    b = torch.randn(seqs, groups, ns, generator=gen)
    c = torch.randn(seqs, groups, ns, generator=gen)
    dt = torch.rand(seqs, heads, generator=gen) * 0.5
    a_coef = -torch.rand(heads, generator=gen) * 4
    _same_as_gathered(
        lambda state, rows: cpu_kernels.ssd_step(x, dt, a_coef, b, c, state, rows), buffer, view
    )


def test_gdn_step_in_the_pool_equals_the_step_on_gathered_rows():
    gen = torch.Generator().manual_seed(2)
    seqs, hk, hv, dk, dv = len(IDS), 2, 4, 32, 64
    buffer, view = _pool(10, (hv, dk, dv), 3, gen)
    q = _l2norm(torch.randn(seqs, hk, dk, generator=gen)) * dk**-0.5
    k = _l2norm(torch.randn(seqs, hk, dk, generator=gen))
    v = torch.randn(seqs, hv, dv, generator=gen)
    g = -torch.rand(seqs, hv, generator=gen) * 6
    beta = torch.rand(seqs, hv, generator=gen)
    _same_as_gathered(
        lambda state, rows: cpu_kernels.gdn_step(q, k, v, g, beta, state, rows), buffer, view
    )


def test_conv_step_in_the_pool_equals_the_step_on_gathered_rows():
    gen = torch.Generator().manual_seed(3)
    seqs, channels, taps = len(IDS), 40, 4
    buffer, view = _pool(10, (channels, taps - 1), 7, gen)
    x = torch.randn(seqs, channels + 8, generator=gen)[:, :channels]  # rows a stride apart
    weight = torch.randn(channels, taps, generator=gen)
    bias = torch.randn(channels, generator=gen)
    _same_as_gathered(
        lambda state, rows: cpu_kernels.conv_step_silu(state, x, weight, bias, rows), buffer, view
    )


def test_rows_out_of_the_pool_are_refused_before_any_write():
    gen = torch.Generator().manual_seed(4)
    buffer, view = _pool(4, (8, 3), 0, gen)
    x = torch.randn(2, 8, generator=gen)
    weight = torch.randn(8, 4, generator=gen)
    before = buffer.clone()
    for bad, match in (
        (torch.tensor([1, 4]), "out of range"),
        (torch.tensor([-1, 2]), "out of range"),
        (torch.tensor([1, 2], dtype=torch.int32), "int64"),
        (torch.tensor([1, 2, 3]), "2 contiguous"),
    ):
        with pytest.raises(ValueError, match=match):
            cpu_kernels.conv_step_silu(view, x, weight, None, bad)
    assert torch.equal(buffer, before)
