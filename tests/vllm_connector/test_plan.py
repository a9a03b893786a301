"""The connector's view of vLLM's caches: which blocks decode needs (BlockClipper), and
how a hand-off becomes regions of vLLM's per-layer tensors (VllmPlan)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hybrid_pd.connector.vllm import BlockClipper, Run, VllmPlan, unpinned

NUM_BLOCKS = 12
BS = 16


def _config(spec_blocks: int = 2) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=40
    )
    mamba = MambaSpec(
        block_size=BS,
        shapes=((3, 96), (2, 16, 16)),
        dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=spec_blocks,
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full.0", "full.1"], full),
            KVCacheGroupSpec(["swa.0"], window),
            KVCacheGroupSpec(["mamba.0"], mamba),
        ],
    )


def _caches(seed: int) -> dict[str, object]:
    """vLLM's CPU shapes: attention (2, blocks, ...), Mamba a list of per-state tensors."""
    g = torch.Generator().manual_seed(seed)
    attn = (2, NUM_BLOCKS, BS, 1, 64)
    return {
        "full.0": torch.randn(attn, generator=g),
        "full.1": torch.randn(attn, generator=g),
        "swa.0": torch.randn(attn, generator=g),
        "mamba.0": [
            torch.randn((NUM_BLOCKS, 3, 96), generator=g),
            torch.randn((NUM_BLOCKS, 2, 16, 16), generator=g),
        ],
    }


def test_clipper_keeps_what_decode_reads():
    clip = BlockClipper(_config(spec_blocks=2))
    # 7 blocks of a 100-token prompt; the window (40 tokens) spans at most 4 blocks;
    # vLLM gives null blocks (0) to sliding-window blocks it freed.
    full = [3, 4, 5, 6, 7, 8, 9]
    swa = [0, 0, 0, 0, 10, 11, 2]
    mamba = [1, 5, 6]  # the running state, then two speculative scratch blocks
    assert clip.clip([full, swa, mamba]) == (tuple(full), (10, 11, 2), (1,))
    # Without scratch blocks the state is the last block.
    assert BlockClipper(_config(spec_blocks=0)).clip([full, swa, [4]]) == (
        tuple(full),
        (10, 11, 2),
        (4,),
    )


def test_clipper_window_keeps_one_block_more_than_the_window():
    clip = BlockClipper(_config())
    swa = list(range(1, 9))
    # ceil(40 / 16) + 1 = 4: the window need not start on a block boundary.
    assert clip.clip([[1], swa, [3, 4, 5]])[1] == (5, 6, 7, 8)


def test_runs_pair_from_the_end_and_merge_consecutive_blocks():
    plan = VllmPlan(_config(), _caches(0))
    src = ((2, 3, 4, 9), (5, 6), (7,))
    # Decode holds the first full-attention block already (its prefix cache): three move.
    dst = ((5, 6, 1), (10, 11), (4,))
    assert plan.runs(src, dst) == [
        Run(0, 3, 5, 2),
        Run(0, 9, 1, 1),
        Run(1, 5, 10, 2),
        Run(2, 7, 4, 1),
    ]
    with pytest.raises(ValueError, match="group 1: 3 blocks wanted, 2 kept"):
        plan.runs(src, ((1,), (1, 2, 3), (4,)))
    with pytest.raises(ValueError, match="3 source and 2 destination groups"):
        plan.runs(src, dst[:2])


def test_regions_move_exactly_the_blocks_and_count_their_bytes():
    cfg = _config()
    src_caches, dst_caches = _caches(1), _caches(2)
    src_plan, dst_plan = VllmPlan(cfg, src_caches), VllmPlan(cfg, dst_caches)
    src = ((2, 3, 4), (5, 6), (7,))
    dst = ((8, 9, 10), (1, 3), (11,))
    runs = src_plan.runs(src, dst)
    sent = src_plan.src_regions(runs)
    got = dst_plan.dst_regions(runs)
    assert [r.shape for r in sent] == [r.shape for r in got]
    before = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone()
              for k, v in dst_caches.items()}  # fmt: skip
    for s, d in zip(sent, got, strict=True):
        d.copy_(s)  # what UCX does, region by region
    pairs = {g: list(zip(src[g], dst[g], strict=True)) for g in range(3)}
    layers = {0: ["full.0", "full.1"], 1: ["swa.0"], 2: ["mamba.0"]}
    moved = {g: {d for _, d in p} for g, p in pairs.items()}
    for g, names in layers.items():
        for name in names:
            if isinstance(src_caches[name], list):
                tensors = zip(src_caches[name], dst_caches[name], before[name], strict=True)
                for s_t, d_t, b_t in tensors:
                    for s, d in pairs[g]:
                        assert torch.equal(d_t[d], s_t[s])
                    for b in set(range(NUM_BLOCKS)) - moved[g]:
                        assert torch.equal(d_t[b], b_t[b])
            else:
                s_t, d_t, b_t = src_caches[name], dst_caches[name], before[name]
                for s, d in pairs[g]:
                    assert torch.equal(d_t[:, d], s_t[:, s])
                for b in set(range(NUM_BLOCKS)) - moved[g]:
                    assert torch.equal(d_t[:, b], b_t[:, b])
    # Only the moved blocks travel: bytes counted equal the bytes of the regions.
    assert src_plan.nbytes(runs) == sum(r.numel() * r.element_size() for r in sent)
    attn_block = BS * 64 * 4
    mamba_block = (3 * 96 + 2 * 16 * 16) * 4
    assert src_plan.nbytes(runs) == 3 * 2 * 2 * attn_block + 2 * 2 * attn_block + mamba_block


def test_one_sided_pieces_are_the_regions_read_at_the_peer():
    """A one-sided read's pieces, resolved against the peer's `memory()` (what its
    handshake sends), are exactly the source regions, and its destinations are exactly
    the destination regions, in the same order: copying byte ranges as UCX's reads do
    gives what the two-sided messages give."""
    import ctypes

    cfg = _config()
    src_caches, dst_caches = _caches(4), _caches(5)
    src_plan, dst_plan = VllmPlan(cfg, src_caches), VllmPlan(cfg, dst_caches)
    src = ((2, 3, 4), (5, 6), (7,))
    dst = ((8, 9, 10), (1, 3), (11,))
    runs = dst_plan.runs(src, dst)
    pieces, local, _ = dst_plan.read_pieces(runs)
    regions = src_plan.memory()  # the peer's, in the order the pieces name them
    sent, got = src_plan.src_regions(runs), dst_plan.dst_regions(runs)
    assert len(pieces) == len(sent) == len(got) == len(local)
    rows = zip(pieces.tolist(), local.tolist(), sent, got, strict=True)
    for (k, off, n), addr, s_t, d_t in rows:
        base, size = regions[k]
        assert off + n <= size
        assert base + off == s_t.data_ptr() and n == s_t.numel() * s_t.element_size()
        assert addr == d_t.data_ptr()
        ctypes.memmove(addr, base + off, n)  # what ucp_get_nbx does
    for name in ("full.0", "swa.0"):
        g = 0 if name == "full.0" else 1
        for s_id, d_id in zip(src[g], dst[g], strict=True):
            assert torch.equal(dst_caches[name][:, d_id], src_caches[name][:, s_id])
    for s_t, d_t in zip(src_caches["mamba.0"], dst_caches["mamba.0"], strict=True):
        assert torch.equal(d_t[11], s_t[7])
    assert int(pieces[:, 2].sum()) == src_plan.nbytes(runs)  # the minimum, nothing more


def test_regions_are_views_not_copies():
    caches = _caches(3)
    plan = VllmPlan(_config(), caches)
    (region,) = plan.src_regions([Run(2, 5, 5, 1)])[:1]
    assert region.data_ptr() == caches["mamba.0"][0][5:6].data_ptr()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity API")
def test_unpinned_widens_only_inside_the_block():
    own = os.sched_getaffinity(0)
    if len(own) < 2:
        pytest.skip("one CPU")
    one = {min(own)}
    os.sched_setaffinity(0, one)
    try:
        seen = []
        with unpinned(own):
            assert os.sched_getaffinity(0) == own
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start()
        t.join()
        assert seen == [own]  # threads started inside keep the wide mask
        assert os.sched_getaffinity(0) == one
    finally:
        os.sched_setaffinity(0, own)
