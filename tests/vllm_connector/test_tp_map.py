"""The mapping between vLLM servers of different tensor-parallel sizes, byte for byte.

Synthetic caches laid out as vLLM's CPU build lays them out (per layer, block first; a
state layer's conv and SSM tensors views into one padded page per block), sharded as
vLLM shards the weights that write them (heads, groups replicated below TP, x / B / C
channels per conv tap). Each decode rank reads its pieces from the prefill ranks its
plan names (a real memmove per piece, as a one-sided read moves them); its caches must
then equal the shards vLLM would hold at the decode size, the blocks no piece names must
stay untouched, and each rank must read exactly its own shard's bytes.
"""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from hybrid_pd.connector.layout import GroupGeometry, KVLayout
from hybrid_pd.connector.vllm.plan import VllmPlan
from hybrid_pd.connector.vllm.rank_plan import RankPlan, check_views, readers, sources, unread
from hybrid_pd.connector.vllm.tp_rows import attention_rows, state_rows
from hybrid_pd.kvcache.tp_layout import TPLayoutError
from tests.vllm_connector.tp_caches import (
    BLOCK,
    DST_BLOCKS,
    LAYERS,
    NUM_BLOCKS,
    SRC_BLOCKS,
    TAPS,
    Attention,
    gdn,
    mamba1,
    mamba2,
    rank_caches,
)


def _read(dst_plan: VllmPlan, src_plans: list[VllmPlan], src_layout, dst_layout, d: int):
    """Decode rank d reads its pieces from each source rank; returns bytes per source."""
    got = {}
    for p in sources([g.rows for g in dst_layout.groups], src_layout.tp_size,
                     dst_layout.tp_size, d):  # fmt: skip
        plan = RankPlan(src_layout, dst_layout, p, d, dst_plan.views)
        runs = plan.runs([SRC_BLOCKS] * len(dst_plan.views), [DST_BLOCKS] * len(dst_plan.views))
        pieces, local, _ = plan.read_pieces(runs)
        regions = src_plans[p].memory()
        for (k, off, n), to in zip(pieces.tolist(), local.tolist(), strict=True):
            assert 0 <= off and off + n <= regions[k][1]
            ctypes.memmove(to, regions[k][0] + off, n)
        # the prefill rank counts the same bytes with its own plan (no cache needed)
        counted = RankPlan(src_layout, dst_layout, p, d).nbytes(
            RankPlan(src_layout, dst_layout, p, d).runs(
                [SRC_BLOCKS] * len(dst_plan.views), [DST_BLOCKS] * len(dst_plan.views)
            )
        )
        assert counted == plan.nbytes(runs)
        got[p] = plan.nbytes(runs)
    return got


CASES = {
    "attention_kv2": [Attention(2)],
    "attention_kv1_replicated": [Attention(1)],
    "mamba2_groups1": [mamba2(1)],
    "mamba2_groups2": [mamba2(2)],
    "mamba2_groups1_conv_dim_first": [mamba2(1, ds=True)],
    "gdn": [gdn()],
    "mamba1": [mamba1()],
    "granite_like": [Attention(1), mamba2(1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("src_size", "dst_size"), [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2)])
def test_decode_ranks_hold_their_shards_after_reading(case, src_size, dst_size):
    kinds = CASES[case]
    if case == "gdn" and max(src_size, dst_size) == 4:
        # its 2 key heads do not split over 4 ranks: refused by name, never mapped
        with pytest.raises(TPLayoutError, match="4"):
            kinds[0].rows(4)
        return
    torch.manual_seed(0)
    fulls = [[k.full() for _ in range(LAYERS)] for k in kinds]
    src = [rank_caches(kinds, fulls, src_size, p) for p in range(src_size)]
    src_plans = [VllmPlan(cfg, caches) for caches, cfg, _, _ in src]
    src_layout = src[0][2]
    for plan, (_, _, layout, _) in zip(src_plans, src, strict=True):
        check_views(plan.views, layout)
    for d in range(dst_size):
        caches, cfg, dst_layout, typed = rank_caches(kinds, fulls, dst_size, d, fill=-7.0)
        assert src_layout.difference(dst_layout) is None
        dst_plan = VllmPlan(cfg, caches)
        check_views(dst_plan.views, dst_layout)
        by_src = _read(dst_plan, src_plans, src_layout, dst_layout, d)
        if src_size <= dst_size:  # one prefill rank holds all its rows
            assert list(by_src) == [d * src_size // dst_size]
        want_bytes = 0
        for g, kind in enumerate(kinds):
            for layer in range(LAYERS):
                name = f"model.layers.{g * LAYERS + layer}.mixer"
                got = typed[name]
                want = kind.shard(fulls[g][layer], dst_size, d)
                for t_got, t_want in zip(got, want, strict=True):
                    for s, b in zip(SRC_BLOCKS[1:], DST_BLOCKS, strict=True):
                        assert torch.equal(t_got[b], t_want[s]), (name, s, b)
                    others = [b for b in range(NUM_BLOCKS) if b not in DST_BLOCKS]
                    assert (t_got[others] == -7.0).all(), "a block no piece names was written"
                    want_bytes += len(DST_BLOCKS) * t_want[0].numel() * t_want.element_size()
        assert sum(by_src.values()) == want_bytes  # its own shard, once: the minimum


def test_readers_count_the_decode_ranks_reading_a_prefill_rank():
    rows = [g.rows for g in rank_caches([Attention(1), mamba2(1)], [[Attention(1).full()] * 2,
            [mamba2(1).full()] * 2], 2, 0)[2].groups]  # fmt: skip
    assert readers(rows, 1, 2, 0) == 2  # TP 1 -> 2: both decode ranks read rank 0
    assert [readers(rows, 2, 1, p) for p in (0, 1)] == [1, 1]
    assert sources(rows, 2, 1, 0) == [0, 1]
    assert [sources(rows, 1, 2, d) for d in (0, 1)] == [[0], [0]]
    assert unread(rows, 2, 1, 0) == []  # Mamba2's x channels: both prefill ranks read
    heads = [
        g.rows for g in rank_caches([Attention(1)], [[Attention(1).full()] * 2], 2, 0)[2].groups
    ]
    # one KV head on every rank: decode reads prefill rank 0 and releases rank 1 unread
    assert sources(heads, 2, 1, 0) == [0] and unread(heads, 2, 1, 0) == [1]
    assert [unread(heads, 4, 2, d) for d in (0, 1)] == [[1], [3]]


def test_attention_with_k_and_v_apart_is_not_taken_for_head_major():
    """A K/V-split cache (vLLM's GPU backends: [2, blocks, block, heads, dim]) has the
    same bytes per block but not one row per head: the check refuses it by name."""
    kind = Attention(2)
    _, cfg, layout, _ = rank_caches([kind], [[kind.full()] * LAYERS], 1, 0)
    split = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 8) for n in cfg.transfer_groups[0].layer_names}
    with pytest.raises(TPLayoutError, match="group 0: 4 cache tensors for 2 layers"):
        check_views(VllmPlan(cfg, split).views, layout)


def test_shapes_vllm_does_not_split_so_are_not_described():
    kind = mamba2(1)
    with pytest.raises(TPLayoutError, match="conv channels per rank"):
        state_rows(kind.full_spec, [(TAPS, 16 + 2 * 6 * 2), (2, 4, 6)], [2, 4], 2)
    with pytest.raises(TPLayoutError, match="KV heads per rank"):
        attention_rows(Attention(2).full_spec, 2, 256, 2)


def test_handshake_accepts_described_pairs_and_names_what_differs():
    kinds = [Attention(1), mamba2(1)]
    fulls = [[k.full() for _ in range(LAYERS)] for k in kinds]
    one, two = (rank_caches(kinds, fulls, n, 0)[2] for n in (1, 2))
    assert one.difference(two) is None and two.difference(one) is None
    kinds = [Attention(1), mamba2(2)]
    fulls = [[k.full() for _ in range(LAYERS)] for k in kinds]
    other = rank_caches(kinds, fulls, 2, 0)[2]
    assert "group 1" in one.difference(other)
    bare = KVLayout(two.block_size, two.page_size_bytes,
                    tuple(GroupGeometry("k", "s", LAYERS, g.slot_bytes, 1) for g in two.groups),
                    two.model, 2)  # fmt: skip
    assert "does not describe its slot rows" in one.difference(bare)
    # attention blocks of another size: rows of other bytes, named with what to do
    g0 = two.groups[0]
    wider = dataclasses.replace(g0.rows[0], row_bytes=2 * g0.rows[0].row_bytes)
    other = dataclasses.replace(
        two, groups=(dataclasses.replace(g0, rows=(wider,)), *two.groups[1:])
    )
    assert "group 0" in one.difference(other)
    assert "give both servers the same --block-size" in one.difference(other)
