"""KVCacheManager and the per-type managers on tiny pools (check after every operation)."""

from __future__ import annotations

import pytest

from hybrid_pd.kvcache.block_pool import IntegrityError
from hybrid_pd.kvcache.ids import BlockId
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
)
from tests.kvcache.kv_checks import CheckedManager, check, tiny_config

FA = FullAttentionSpec(1, 4, "float32")
SW = SlidingWindowSpec(1, 4, "float32", window=8)
CL = ChunkedLocalSpec(1, 4, "float32", chunk_size=8)
ST = StateSpec(((2, 3), (4,)), ("float32", "float32"), mamba_type="gdn")


def make(*specs, num_blocks: int = 32, span: int = 1, **kw) -> KVCacheManager:
    """A manager that runs `check` after every mutating call."""
    config = tiny_config(*specs, block_size=kw.pop("bs", 4), span=span)
    mgr = CheckedManager(config, num_blocks, **kw)
    check(mgr)
    return mgr


def run(mgr: KVCacheManager, rid: str, tokens: list[int], hit: bool = True):
    """New request: prefix hit, allocate the rest of the prompt, compute it."""
    h = mgr.find_prefix_hit(tokens) if hit else None
    ids = mgr.allocate_slots(rid, tokens, len(tokens) - (h.num_tokens if h else 0), h)
    assert ids is not None
    mgr.finish_state_copies(rid)
    mgr.commit_computed(rid, len(tokens))
    return ids


def state_of(mgr: KVCacheManager) -> tuple:
    blocks = [mgr.pool.get_block(BlockId(i)) for i in range(mgr.pool.num_blocks)]
    return (
        mgr.pool._free_queue_ids(),
        mgr.pool._free_run_ids(),
        [(b.ref_cnt, b.cache_key) for b in blocks],
        {r: mgr.block_ids(r) for m in mgr.managers for r in m.req_blocks},
        mgr.num_requests,
    )


# -- allocation -----------------------------------------------------------------------------


def test_refusal_returns_none_and_changes_nothing() -> None:
    mgr = make(FA, SW, num_blocks=1 + 5)
    assert mgr.allocate_slots("a", list(range(8)), 8) == ([1, 2], [3, 4])
    before = state_of(mgr)
    assert mgr.allocate_slots("b", list(range(100, 112)), 12) is None  # needs 6, 1 free
    assert state_of(mgr) == before and not mgr.has_request("b")
    assert mgr.allocate_slots("a", list(range(12)), 12) is None  # needs 2 more, 1 free
    assert state_of(mgr) == before and mgr.num_computed("a") == 0
    mgr.commit_computed("a", 8)
    assert mgr.allocate_slots("a", list(range(12)), 4) is None  # full and SW: one each
    mgr.free("a")


def test_exact_fit_is_allowed_and_lengths_follow_the_tokens() -> None:
    mgr = make(FA, SW, num_blocks=1 + 6)
    ids = mgr.allocate_slots("a", list(range(9)), 9)
    assert ids is not None and [len(x) for x in ids] == [3, 3]
    assert mgr.pool.num_free_blocks == 0
    mgr.free("a")
    mgr.free("a")  # twice is safe
    mgr.free("never-seen")


def test_commit_cannot_go_backwards_and_no_state_means_no_snapshot() -> None:
    mgr = make(FA)
    run(mgr, "a", list(range(8)), hit=False)
    with pytest.raises(ValueError, match="backwards"):
        mgr.commit_computed("a", 4)
    assert not mgr.snapshot_states("a")  # no state group
    mgr.free("a")


# -- full attention prefix hits -------------------------------------------------------------


def test_full_attention_prefix_hit_reuses_blocks() -> None:
    mgr = make(FA)
    a_tokens = list(range(10))
    a_ids = run(mgr, "a", a_tokens)
    hit = mgr.find_prefix_hit(a_tokens)
    assert hit.num_tokens == 8 and [b.block_id for b in hit.blocks[0]] == a_ids[0][:2]
    assert hit.num_blocks_to_take == 0  # held by "a"
    assert mgr.find_prefix_hit(a_tokens[:8]).num_tokens == 4  # the last token is never a hit
    assert mgr.find_prefix_hit(a_tokens[:9]).num_tokens == 8
    assert mgr.find_prefix_hit([99, *a_tokens[1:]]).num_tokens == 0
    b_ids = mgr.allocate_slots("b", [*a_tokens, 7], 3, hit)
    assert b_ids is not None and b_ids[0][:2] == a_ids[0][:2] and b_ids[0][2] != a_ids[0][2]
    assert [mgr.pool.get_block(BlockId(b)).ref_cnt for b in a_ids[0]] == [2, 2, 1]
    assert mgr.num_computed("b") == 8
    mgr.free("a")
    mgr.free("b")
    again = mgr.find_prefix_hit(a_tokens)  # freed blocks stay cached
    assert again.num_tokens == 8 and again.num_blocks_to_take == 2


def test_caching_disabled_never_hits() -> None:
    mgr = make(FA, ST, num_blocks=16, enable_caching=False)
    run(mgr, "a", list(range(8)))
    mgr.free("a")
    assert mgr.find_prefix_hit(list(range(12))).num_tokens == 0
    assert mgr.pool.num_cached_blocks == 0


# -- sliding window and chunked local -------------------------------------------------------


def test_sliding_window_hit_uses_null_blocks_outside_the_window() -> None:
    mgr = make(SW, num_blocks=1 + 6)
    a = list(range(21))
    assert run(mgr, "a", a) == ([1, 2, 3, 4, 5, 6],)
    assert mgr.allocate_slots("a", [*a, 50], 1) == ([0, 0, 0, 4, 5, 6],)  # reads 14..21
    filler = mgr.allocate_slots("f", list(range(100, 112)), 12)  # evicts a's blocks 0..2
    assert filler is not None and sorted(filler[0]) == [1, 2, 3]
    mgr.free("f")
    hit = mgr.find_prefix_hit([*a[:20], 60, 61])
    assert hit.num_tokens == 20  # position 20 reads 13..20: blocks 3 and 4 only
    assert [b.block_id for b in hit.blocks[0]] == [0, 0, 0, 4, 5]
    ids = mgr.allocate_slots("b", [*a[:20], 60, 61], 2, hit)
    assert ids is not None and ids[0][:5] == [0, 0, 0, 4, 5] and ids[0][5] not in (0, 4, 5)
    for rid in ("a", "b"):
        mgr.free(rid)


def test_full_plus_sliding_window_hit() -> None:
    mgr = make(FA, SW)
    a = list(range(21))
    a_full, a_sw = run(mgr, "a", a)
    hit = mgr.find_prefix_hit([*a[:20], 5])
    assert hit.num_tokens == 20
    full, sw = ([b.block_id for b in bl] for bl in hit.blocks)
    assert full == a_full[:5] and sw == [0, 0, 0, *a_sw[3:5]]
    mgr.allocate_slots("b", [*a[:20], 5], 1, hit)
    mgr.free("a")
    mgr.free("b")


def test_chunked_local_releases_whole_chunks_and_hits() -> None:
    mgr = make(FA, CL)
    a = list(range(23))
    a_full, a_cl = run(mgr, "a", a)
    mgr.release_out_of_window("a")  # position 23 is in chunk 16..23
    assert mgr.block_ids("a")[1] == [0, 0, 0, 0, a_cl[4], a_cl[5]]
    hit = mgr.find_prefix_hit([*a[:20], 1, 2])
    assert hit.num_tokens == 20
    assert [b.block_id for b in hit.blocks[1]] == [0, 0, 0, 0, a_cl[4]]
    hit16 = mgr.find_prefix_hit([*a[:16], 1])
    assert hit16.num_tokens == 16 and all(b.is_null for b in hit16.blocks[1])
    ids = mgr.allocate_slots("b", [*a[:16], 1], 1, hit16)
    assert ids is not None and ids[0][:4] == a_full[:4] and ids[1][:4] == [0, 0, 0, 0]
    for rid in ("a", "b"):
        mgr.free(rid)


# -- state groups ---------------------------------------------------------------------------


@pytest.mark.parametrize("span", [1, 2])
def test_state_hit_needs_a_snapshot_on_a_block_boundary(span: int) -> None:
    mgr = make(FA, ST, span=span)
    a = list(range(16))
    a_full, a_state = run(mgr, "a", a)
    assert mgr.find_prefix_hit([*a, 1]).num_tokens == 0  # state still live, no snapshot
    mgr.free("a")  # finished on a block boundary: the state becomes a snapshot
    c = list(range(100, 118))
    run(mgr, "c", c)
    mgr.free("c")  # 18 tokens: no snapshot
    assert mgr.find_prefix_hit([*c, 1]).num_tokens == 0
    hit = mgr.find_prefix_hit([*a, 1, 2, 3])
    assert hit.num_tokens == 16
    assert [b.block_id for b in hit.blocks[1]] == a_state
    ids = mgr.allocate_slots("b", [*a, 1, 2, 3], 3, hit)
    assert ids is not None and ids[0][:4] == a_full and set(ids[1]).isdisjoint(a_state)
    assert mgr.pending_state_copies("b") == list(zip(a_state, ids[1], strict=True))
    assert [mgr.pool.get_block(BlockId(b)).ref_cnt for b in a_state] == [1] * span
    mgr.finish_state_copies("b")
    assert mgr.pending_state_copies("b") == []
    assert [mgr.pool.get_block(BlockId(b)).ref_cnt for b in a_state] == [0] * span
    mgr.free("b")


def test_hit_is_cut_to_the_boundary_full_and_state_agree_on() -> None:
    mgr = make(FA, ST)
    a = list(range(22))
    h = mgr.find_prefix_hit(a)
    mgr.allocate_slots("a", a, 8, h)
    mgr.commit_computed("a", 8)
    assert mgr.snapshot_states("a")  # snapshot after 8 tokens
    mgr.finish_state_copies("a")
    assert mgr.allocate_slots("a", a, 14) is not None
    mgr.commit_computed("a", 22)
    mgr.free("a")  # 22 tokens: full blocks 0..4 cached, no snapshot at 22
    hit = mgr.find_prefix_hit([*a, 9])
    assert hit.num_tokens == 8 and len(hit.blocks[0]) == 2 and len(hit.blocks[1]) == 1


@pytest.mark.parametrize("spare", [0, 1])
def test_state_hit_allocation_fits_exactly_and_never_shares_across_groups(spare: int) -> None:
    # State group first: its fresh pages must not be taken from the full group's hit blocks,
    # which sit at the head of the free queue; and the count must not reserve them twice.
    mgr = make(ST, FA, num_blocks=8 + spare, bs=8)
    a, e, z = list(range(16)), list(range(100, 108 + 8 * spare)), list(range(200, 208))
    run(mgr, "a", a)  # state 1 + full 2
    run(mgr, "e", e)  # state 1 + full 1 (+ spare)
    run(mgr, "z", z)  # state 1 + full 1
    mgr.free("a")
    mgr.free("e")
    hit = mgr.find_prefix_hit([*a, 1])
    assert hit.num_tokens == 16 and hit.num_blocks_to_take == 3
    assert mgr.pool._free_queue_ids()[:3] == [1, 3, 2]  # a's snapshot, then its full blocks
    assert mgr.pool.num_free_blocks == 5 + spare  # 3 hit blocks + fresh state + 1 full block
    ids = mgr.allocate_slots("b", [*a, 1], 1, hit)
    assert ids is not None and mgr.pool.num_free_blocks == spare
    assert ids[1][:2] == [2, 3] and set(ids[0]).isdisjoint(ids[1])
    mgr.free("b")
    mgr.free("z")


def test_snapshot_states_mid_request() -> None:
    mgr = make(FA, ST, num_blocks=1 + 7)
    a = list(range(13))
    h = mgr.find_prefix_hit(a)
    ids = mgr.allocate_slots("a", a, 6, h)
    assert ids is not None
    mgr.commit_computed("a", 6)
    before = state_of(mgr)
    assert not mgr.snapshot_states("a")  # not on a block boundary
    assert state_of(mgr) == before
    mgr.allocate_slots("a", a, 2)
    mgr.commit_computed("a", 8)
    old = mgr.block_ids("a")[1]
    assert mgr.snapshot_states("a")
    new = mgr.block_ids("a")[1]
    assert new != old and mgr.pending_state_copies("a") == [(old[0], new[0])]
    assert not mgr.snapshot_states("a")  # a copy is pending
    mgr.finish_state_copies("a")
    assert not mgr.snapshot_states("a")  # the snapshot for 8 tokens exists
    hit = mgr.find_prefix_hit([*a[:8], 5])
    assert hit.num_tokens == 8 and [b.block_id for b in hit.blocks[1]] == old
    ids = mgr.allocate_slots("b", [*a[:8], 5], 1, hit)  # snapshot, fresh page, full block
    assert mgr.pending_state_copies("b") == [(old[0], ids[1][0])]  # type: ignore[index]
    mgr.allocate_slots("a", a, 4)
    mgr.commit_computed("a", 12)
    assert mgr.pool.num_free_blocks == 0
    assert not mgr.snapshot_states("a")  # no room for fresh pages
    mgr.free("b")  # pending copy dropped with the request
    mgr.free("a")


def test_check_integrity_catches_double_ownership() -> None:
    mgr = make(FA)
    run(mgr, "a", list(range(8)))
    run(mgr, "b", list(range(50, 58)))
    mgr.managers[0].req_blocks["b"].append(mgr.managers[0].req_blocks["a"][0])
    with pytest.raises(IntegrityError, match="ref count 1 but requests hold 2"):
        mgr.check_integrity()


def test_allocate_external_holds_only_what_later_steps_read() -> None:
    mgr = make(FA, SW, ST, num_blocks=1 + 8)
    a = list(range(21))
    ids = mgr.allocate_external("a", a, 20)  # KV of 20 tokens arrives from a prefill worker
    assert ids is not None and [len(x) for x in ids] == [5, 5, 1]
    assert ids[1][:3] == [0, 0, 0] and 0 not in ids[1][3:]  # position 20 reads 13..20
    assert mgr.num_computed("a") == 20 and mgr.pool.num_free_blocks == 0
    before = state_of(mgr)
    assert mgr.allocate_external("b", list(range(50, 60)), 8) is None
    assert state_of(mgr) == before
    with pytest.raises(ValueError, match="already holds"):
        mgr.allocate_external("a", a, 20)
    mgr.commit_computed("a", 20)
    mgr.free("a")  # on a block boundary: blocks and the state snapshot stay cached
    hit = mgr.find_prefix_hit(a)
    assert hit.num_tokens == 20 and [b.block_id for b in hit.blocks[2]] == ids[2]


def test_allocate_external_takes_what_the_pool_caches() -> None:
    """Decode-side reuse: the attention groups take cached blocks of the prompt's leading
    positions they keep (references counted), the state group fresh pages; a failed load
    leaves them cached; a pool short of room changes nothing; `reuse=False` takes none."""
    mgr = make(FA, SW, ST, num_blocks=1 + 14)
    turn1 = list(range(13))
    cached = run(mgr, "a", turn1)[0][:3]
    mgr.free("a")  # blocks of positions 0..11 stay cached (3 per attention group)
    turn2 = [*turn1, *range(100, 107), 7]  # 20 tokens then one more: 0..11 cached
    ids = mgr.allocate_external("b", turn2, 20)
    assert ids is not None and [len(x) for x in ids] == [5, 5, 1]
    assert mgr.num_held("b") == (3, 0, 0)  # the window at 20 starts in block 3: none held
    assert mgr.held_tokens("b") == 12 and ids[0][:3] == cached and ids[1][:3] == [0, 0, 0]
    mgr.commit_computed("b", 20)
    mgr.free("b")
    ids = mgr.allocate_external("c", turn2, 20)  # all 5 whole blocks cached now
    assert mgr.num_held("c") == (5, 2, 0) and mgr.held_tokens("c") == 20
    mgr.free("c", keep_cached=False)  # a failed load: the held blocks stay cached
    assert mgr.find_prefix_hit(turn2).num_tokens == 20
    assert mgr.allocate_external("d", turn2, 20, reuse=False) is not None
    assert mgr.num_held("d") == (0, 0, 0) and mgr.held_tokens("d") == 0
    mgr.free("d")
    small = make(FA, ST, num_blocks=1 + 4)
    run(small, "a", list(range(8)))
    small.free("a")  # 2 attention blocks and a state snapshot cached, 4 blocks free
    before = state_of(small)
    assert small.allocate_external("x", list(range(30)), 29) is None
    assert state_of(small) == before
    assert small.allocate_external("y", list(range(13)), 12) is not None
    assert small.num_held("y") == (2, 0)
