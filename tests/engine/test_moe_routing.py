"""routed_tokens: the MoE layers' grouping of (token, slot) pairs by expert; add_routed: their
sum, and its one-token path."""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.engine.models.common import _add_by_expert, _add_one_token, add_routed, routed_tokens


@pytest.mark.parametrize(("tokens", "experts", "k"), [(1, 4, 2), (37, 8, 2), (64, 64, 6)])
def test_routed_tokens_equal_the_per_expert_nonzero_loop(tokens, experts, k):
    gen = torch.Generator().manual_seed(tokens)
    top_idx = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices
    want = []
    for e in top_idx.unique().tolist():
        token, slot = torch.nonzero(top_idx == e, as_tuple=True)
        want.append((e, token.tolist(), slot.tolist()))
    got = [(e, t.tolist(), s.tolist()) for e, t, s in routed_tokens(top_idx)]
    assert got == want
    # every pair exactly once, and each names its own expert
    pairs = sorted((t, s) for _, ts, ss in got for t, s in zip(ts, ss, strict=True))
    assert pairs == [(t, s) for t in range(tokens) for s in range(k)]
    assert all(int(top_idx[t, s]) == e for e, ts, ss in got for t, s in zip(ts, ss, strict=True))


def test_routed_tokens_of_no_tokens():
    assert list(routed_tokens(torch.empty(0, 2, dtype=torch.long))) == []


def test_one_token_adds_its_experts_in_the_routed_order_bit_for_bit():
    """The one-token path adds in ascending expert order, as the routed path does; topk's
    order (most often another) would round differently."""
    gen = torch.Generator().manual_seed(0)
    other_order_differs = 0
    for _ in range(50):
        top_idx = torch.rand(1, 8, generator=gen).topk(3, dim=-1).indices
        weights = torch.rand(1, 3, generator=gen)
        ys = torch.randn(8, 1, 16, generator=gen)

        def contribution(e, tokens, slots, ys=ys, weights=weights):
            return ys[e][tokens] * weights[tokens, slots, None]

        want = _add_by_expert(torch.zeros(1, 16), top_idx, contribution)
        got = add_routed(torch.zeros(1, 16), top_idx, contribution)
        assert torch.equal(_add_one_token(torch.zeros(1, 16), top_idx, contribution), want)
        assert torch.equal(got, want)
        in_topk_order = torch.zeros(1, 16)
        for slot, e in enumerate(top_idx[0].tolist()):
            in_topk_order += contribution(e, slice(0, 1), slot)
        other_order_differs += not torch.equal(in_topk_order, want)
    assert other_order_differs >= 10
