"""Prefill-chunk attention (`paged_attention._attend_seq`) against a dense reference: a chunk
written after earlier tokens, GQA, sliding window and chunked masks, and the explicit-score
path (soft cap, attention sinks, queries in slices); on the CPU both the C kernel
(`cpu_kernels.prompt_attention`) and the PyTorch path it replaces (the path of other
devices)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_pd.engine import cpu_kernels, paged_attention
from hybrid_pd.engine.batch import SeqInfo
from hybrid_pd.engine.paged_attention import _attend_seq, _seq_plan

BS, HQ, HKV, D = 4, 6, 2, 8


def _reference(q, keys, values, num_computed, scale, window, chunk, softcap, sinks):
    """q [n, Hq, D] at positions num_computed.., keys/values [T, Hkv, D] at 0.."""
    n, t = q.shape[0], keys.shape[0]
    qpos = torch.arange(num_computed, num_computed + n)[:, None]
    kpos = torch.arange(t)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= (qpos - kpos) < window
    if chunk is not None:
        allowed &= (kpos // chunk) == (qpos // chunk)
    group = HQ // HKV
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = F.softmax(scores, dim=-1)
    else:  # one extra logit per head in the denominator, with no value
        sink = sinks.double()[:, None, None].expand(HQ, n, 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v).float()


@pytest.mark.parametrize(
    ("window", "chunk", "softcap", "sinks"),
    [
        (None, None, None, False),
        (5, None, None, False),
        (None, 8, None, False),
        (5, None, 3.0, False),
        (None, None, None, True),
        (5, None, None, True),
        (5, None, 3.0, True),
    ],
)
@pytest.mark.parametrize("num_computed", [0, 7])
# kernel: the C kernel (CPU, float32); pytorch: the path it replaces; pytorch-sliced: that
# path's explicit scores a few queries at a time and, on its SDPA path, a sliding window's
# queries in slices, each over the keys its queries see
@pytest.mark.parametrize("path", ["kernel", "pytorch", "pytorch-sliced"])
def test_attend_seq_matches_reference(
    window, chunk, softcap, sinks, num_computed, path, monkeypatch
):
    sdpa = softcap is None and not sinks
    sliced = path == "pytorch-sliced"
    if path != "kernel":
        monkeypatch.setattr(cpu_kernels, "prompt_attention", lambda *a, **kw: None)
    if sliced:
        if sdpa and window is None:
            pytest.skip("SDPA path: slices only for a sliding window")
        monkeypatch.setattr(paged_attention, "_SCORES", 2 * HQ * 16)
        monkeypatch.setattr(paged_attention, "_WINDOW_SLICE", 2)  # slices of max(5, 2)
    g = torch.Generator().manual_seed(0)
    n = 12
    total = num_computed + n
    table = [3, 1, 4, 0, 2]  # enough blocks for `total`, out of order
    cache = torch.randn(6, 2, BS, HKV, D, generator=g)
    keys = torch.randn(total, HKV, D, generator=g)
    values = torch.randn(total, HKV, D, generator=g)
    for pos in range(num_computed):  # the earlier tokens are already in the pages
        cache[table[pos // BS], 0, pos % BS] = keys[pos]
        cache[table[pos // BS], 1, pos % BS] = values[pos]
    q = torch.randn(n, HQ, D, generator=g)
    sink = torch.randn(HQ, generator=g) * 2 if sinks else None
    seq = SeqInfo("r", 0, n, num_computed, (table,))
    plan = _seq_plan(seq, table, BS, window, chunk, torch.device("cpu"))
    assert plan.window == (window if sliced else None)
    new = slice(num_computed, total)
    out = _attend_seq(q, keys[new], values[new], cache, plan, 0.3, softcap, sink)
    expected = _reference(q, keys, values, num_computed, 0.3, window, chunk, softcap, sink)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
