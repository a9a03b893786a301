"""Transfers between tensor-parallel groups, byte for byte, for every group kind.

A whole-model (TP 1) pool is filled with random bytes; each prefill rank's pool is cut from
it by a reference slicer (independent of the plan's own piece mapping); the plan's pieces
are applied to empty decode rank pools; then every decode rank's slots must be what the
same slicer cuts from the whole pool for that rank, and the bytes each decode rank
received must be exactly its share of the shipped slots' data (no padding, nothing twice).
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.tp_plan import DST_OFF, DST_RANK, NBYTES, SRC_OFF, SRC_RANK, ShardedPlan
from hybrid_pd.engine.tp.plans import plan_for
from hybrid_pd.kvcache.grouping import plan_groups
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config, load_config
from hybrid_pd.kvcache.tp_layout import rank_kv_config, rank_units, slot_rows
from tests import checkpoints

# checkpoint, overrides, TP sizes to pair
CASES = {
    "llama": ("llama", {}, (1, 2, 4)),  # full attention, KV heads replicated at 4
    "gemma3": ("gemma3", {}, (1, 2)),  # sliding window + full
    "granite_g2": ("granite_hybrid", {}, (1, 2, 4)),  # Mamba2, 2 groups (replicated at 4)
    "granite_g1": ("granite_hybrid", {"name": "granite_g1", "mamba_n_groups": 1}, (1, 2)),
    "qwen3_5": ("qwen3_5", {}, (1, 2)),  # Gated DeltaNet + gated attention
    "jamba": ("jamba", {}, (1, 2)),  # Mamba1
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_plan")
    return {
        name: load_config(checkpoints.BUILDERS[b](root, **o)) for name, (b, o, _) in CASES.items()
    }


def _kv(config: dict, size: int):
    """(whole-model grouping, this size's rank grouping, its layout)."""
    full = plan_groups(cache_spec_from_config(config, "float32"), ref_len=2048)  # as the engine
    if size == 1:
        return full, full, KVLayout.of(full, "m")
    rank_spec = cache_spec_from_config(plan_for(config, size).rank_config, "float32")
    rank = rank_kv_config(full, rank_spec)
    return full, rank, KVLayout.of(rank, "m", full, size)


def _cut(whole_pool, full, rank_cfg, size: int, rank: int, owner: list[int]) -> torch.Tensor:
    """Reference: rank `rank`'s pool cut from the whole pool, slot tensor by slot tensor,
    block b read as a block of group owner[b]."""
    out = torch.zeros(len(owner), rank_cfg.page_size_bytes, dtype=torch.uint8)
    for g, (g_full, g_rank) in enumerate(zip(full.groups, rank_cfg.groups, strict=True)):
        mine = torch.tensor([b for b, o in enumerate(owner) if o == g], dtype=torch.long)
        rows_full = slot_rows(g_full.spec, g_full.spec, full.block_size)
        rows_rank = slot_rows(g_full.spec, g_rank.spec, full.block_size)
        for layer in range(len(g_full.layer_names)):
            for tw, tr in zip(rows_full, rows_rank, strict=True):
                src = layer * g_full.slot_bytes + tw.offset
                dst = layer * g_rank.slot_bytes + tr.offset
                row = tw.row_bytes
                pieces, base = [], 0
                for units, width, rep in tw.segments:
                    for u in rank_units(units, size, rank, rep):
                        a = src + (base + u * width) * row
                        pieces.append(whole_pool[mine, a : a + width * row])
                    base += units * width
                data = torch.cat(pieces, dim=1)
                out[mine, dst : dst + data.shape[1]] = data
    return out


def _data_bytes(full, rank_cfg, size: int, rank: int, blocks_per_group) -> int:
    """A rank's share of the shipped slots' data, padding excluded."""
    total = 0
    for g, (g_full, g_rank) in enumerate(zip(full.groups, rank_cfg.groups, strict=True)):
        per_slot = 0
        for tr in slot_rows(g_full.spec, g_rank.spec, full.block_size):
            for units, width, rep in tr.segments:
                per_slot += len(rank_units(units, size, rank, rep)) * width * tr.row_bytes
        total += per_slot * len(g_full.layer_names) * blocks_per_group[g]
    return total


@pytest.mark.parametrize("case", sorted(CASES))
def test_pull_between_any_tp_pair_is_byte_exact(case, configs):
    config, sizes = configs[case], CASES[case][2]
    rng = random.Random(0)
    num_blocks = 40
    for a, b in itertools.product(sizes, sizes):
        full, p_cfg, p_layout = _kv(config, a)
        _, d_cfg, d_layout = _kv(config, b)
        assert p_layout.difference(d_layout) is None
        # per group: its own source and destination blocks (a block holds one group)
        n = len(full.groups)
        src_all = rng.sample(range(1, num_blocks), 3 * n)
        dst_all = rng.sample(range(1, num_blocks), 3 * n)
        src = [src_all[3 * g : 3 * g + 3] for g in range(n)]
        dst = [dst_all[3 * g : 3 * g + 3] for g in range(n)]
        owner = [-1] * num_blocks
        for g in range(n):
            for blk in src[g]:
                owner[blk] = g
        whole = torch.randint(0, 256, (num_blocks, full.page_size_bytes), dtype=torch.uint8)
        p_pools = [_cut(whole, full, p_cfg, a, r, owner) for r in range(a)]
        d_pools = [torch.zeros(num_blocks, d_cfg.page_size_bytes, dtype=torch.uint8)] * b
        d_pools = [p.clone() for p in d_pools]
        plan = ShardedPlan(p_layout, d_layout, lambda p=p_pools: p)
        runs = plan.runs(src, dst)
        for s_rank, s_off, d_rank, d_off, n in runs[
            :, [SRC_RANK, SRC_OFF, DST_RANK, DST_OFF, NBYTES]
        ]:
            d_pools[d_rank].view(-1)[d_off : d_off + n] = p_pools[s_rank].view(-1)[
                s_off : s_off + n
            ]
        for r in range(b):
            want = _cut(whole, full, d_cfg, b, r, owner)
            for g, group in enumerate(full.groups):
                lo = 0
                hi = len(group.layer_names) * d_cfg.groups[g].slot_bytes
                for s_id, d_id in zip(src[g], dst[g], strict=True):
                    assert torch.equal(d_pools[r][d_id, lo:hi], want[s_id, lo:hi]), (a, b, r, g)
        by_rank = plan.bytes_by_rank(runs, "dst")
        shipped = [len(s) for s in src]
        if a != b:  # slot pieces: each rank's data exactly, nothing else
            assert by_rank == [_data_bytes(full, d_cfg, b, r, shipped) for r in range(b)]
        else:  # equal sizes: whole pages, rank to rank
            assert by_rank == [sum(shipped) * d_cfg.page_size_bytes] * b
        # the iov rows the transport gets describe exactly the same bytes, in the pools
        iov, owners = ShardedPlan(p_layout, d_layout, lambda d=d_pools: d).iov(runs, "dst")
        assert int(iov[:, 1].sum()) == plan.nbytes(runs) and len(owners) == b
        bases = {int(p.data_ptr()) for p in d_pools}
        assert all(
            any(0 <= int(addr) - base < d_pools[0].numel() * 8 for base in bases)
            for addr in iov[:, 0]
        )


def test_layouts_that_cannot_map_are_refused_by_name(configs):
    _, _, two = _kv(configs["granite_g2"], 2)
    _, _, one_other = _kv(configs["llama"], 1)
    assert "mismatch" in (two.difference(one_other) or "")
    # a state spread over several blocks moves only between equal sizes
    spread = KVLayout(
        two.block_size,
        two.page_size_bytes,
        tuple(
            g.__class__(g.kind, g.spec, g.num_layers, g.slot_bytes, 2, g.rows)
            if g.kind == "state"
            else g
            for g in two.groups
        ),
        two.model,
        2,
    )
    _, _, single = _kv(configs["granite_g2"], 1)
    assert "spreads a state" in spread.difference(
        KVLayout(single.block_size, single.page_size_bytes, spread.groups, single.model, 1)
    )


def test_merged_pieces_are_few_for_equal_sizes(configs):
    """Equal sizes move runs of whole pages: consecutive blocks are one piece per rank."""
    _, _, layout = _kv(configs["qwen3_5"], 2)
    plan = ShardedPlan(layout, layout, lambda: [])
    empty = [[]] * (len(layout.groups) - 1)
    runs = plan.runs([[3, 4, 5, 6], *empty], [[7, 8, 9, 10], *empty])
    assert len(runs) == 2 and set(np.unique(runs[:, DST_RANK]).tolist()) == {0, 1}
