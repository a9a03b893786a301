"""routed_tokens: the MoE layers' grouping of (token, slot) pairs by expert."""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.engine.models.common import routed_tokens


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
