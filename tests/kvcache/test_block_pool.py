"""BlockPool: free runs, LRU eviction, ref counts, prefix cache, integrity checks."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybrid_pd.kvcache.block_pool import (
    BlockPool,
    IntegrityError,
    KVBlock,
    NoFreeBlocksError,
)
from hybrid_pd.kvcache.hashing import BlockHash, hash_block
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID, BlockId, GroupId

G0, G1 = GroupId(0), GroupId(1)


def h(i: int) -> BlockHash:
    return hash_block(None, [i])


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def queue(pool: BlockPool) -> list[int]:
    """Cached free blocks, evict first to evict last."""
    return list(pool._free_queue_ids())


def runs(pool: BlockPool) -> list[tuple[int, int]]:
    """Uncached free blocks as [start, end) runs."""
    return pool._free_run_ids()


def free_ids(pool: BlockPool) -> set[int]:
    return set(queue(pool)) | {b for s, e in runs(pool) for b in range(s, e)}


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    refs = [pool.get_block(BlockId(i)).ref_cnt for i in range(pool.num_blocks)]
    keys = [pool.get_block(BlockId(i)).cache_key for i in range(pool.num_blocks)]
    return queue(pool), runs(pool), refs, keys, dict(pool._cache), pool.num_free_blocks


def make(num_blocks: int = 6, enable_caching: bool = True) -> BlockPool:
    pool = BlockPool(num_blocks, enable_caching=enable_caching)
    pool.check_integrity()
    return pool


# -- basics -------------------------------------------------------------------------------


def test_initial_state() -> None:
    pool = make(6)
    assert pool.num_blocks == 6
    assert pool.num_free_blocks == 5
    assert pool.num_cached_blocks == 0
    assert pool.usage() == 0.0
    assert queue(pool) == [] and runs(pool) == [(1, 6)]
    assert pool.null_block is pool.get_block(NULL_BLOCK_ID)
    assert pool.null_block.is_null and pool.null_block.ref_cnt == 0


def test_init_and_argument_errors() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)
    pool = make(2)
    assert runs(pool) == [(1, 2)]
    with pytest.raises(IndexError):
        pool.get_block(BlockId(2))
    with pytest.raises(IndexError):
        pool.get_block(BlockId(-1))
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert not pool.can_allocate(-1)


def test_uncached_blocks_are_handed_out_as_runs() -> None:
    pool = make(6)
    a = pool.allocate(3)
    pool.check_integrity()
    assert ids(a) == [1, 2, 3] and all(b.ref_cnt == 1 for b in a)
    assert pool.usage() == pytest.approx(3 / 5)
    pool.free([a[2], a[0]])  # uncached: they join the runs, 3 merges with [4, 6)
    pool.check_integrity()
    assert queue(pool) == [] and runs(pool) == [(1, 2), (3, 6)]
    b = pool.allocate(3)
    pool.check_integrity()
    assert ids(b) == [3, 4, 5]  # one run holds all three: no split
    assert runs(pool) == [(1, 2)]
    pool.free(reversed(b))  # freed in any order, they merge back into one run
    pool.free([a[1]])
    pool.check_integrity()
    assert runs(pool) == [(1, 6)]


def test_runs_are_preferred_to_scattered_blocks() -> None:
    pool = make(17)
    held = pool.allocate(16)
    pool.free(held[0:1] + held[3:4] + held[6:7] + held[9:16])  # holes 1, 4, 7 and [10, 17)
    pool.check_integrity()
    assert ids(pool.allocate(5)) == [10, 11, 12, 13, 14]
    assert ids(pool.allocate(1)) in ([1], [4], [7], [15], [16])
    pool.check_integrity()


def test_cached_blocks_evicted_in_lru_order_after_uncached_ones() -> None:
    pool = make(8)
    a = pool.allocate(7)
    for i, b in enumerate(a[:4]):
        pool.cache_block(b, h(i), G0)
    pool.free([a[2], a[0], a[3], a[1], a[6], a[5], a[4]])
    pool.check_integrity()
    assert queue(pool) == [3, 1, 4, 2] and runs(pool) == [(5, 8)]
    assert ids(pool.allocate(2)) == [5, 6]  # uncached first, cache untouched
    assert pool.num_cached_blocks == 4
    got = pool.allocate(3)  # the last uncached one, then the two least recently freed
    pool.check_integrity()
    assert ids(got) == [7, 1, 3]  # evicted ones in id order
    assert pool.lookup(h(2), G0) is None and pool.lookup(h(0), G0) is None
    assert queue(pool) == [4, 2] and pool.num_cached_blocks == 2


def test_allocate_zero_and_exhaustion() -> None:
    pool = make(4)
    assert pool.allocate(0) == []
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    got = pool.allocate(3)
    pool.check_integrity()
    assert NULL_BLOCK_ID not in ids(got)
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    assert pool.allocate(0) == []
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_no_free_blocks_error_leaves_state_unchanged() -> None:
    pool = make(6)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i), G0)
    pool.free([blocks[1]])
    pool.check_integrity()
    before = snapshot(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    pool.check_integrity()
    assert snapshot(pool) == before
    assert pool.lookup(h(1), G0) is blocks[1]


def test_eviction_of_cached_keys_on_reuse() -> None:
    pool = make(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i), G0)
        pool.check_integrity()
    assert pool.num_cached_blocks == 3
    pool.free(blocks)
    pool.check_integrity()
    # Cached-free blocks remain findable until reused.
    assert [pool.lookup(h(i), G0) for i in range(3)] == blocks
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 3
    (reused,) = pool.allocate(1)
    pool.check_integrity()
    assert reused is blocks[0] and reused.cache_key is None
    assert pool.lookup(h(0), G0) is None
    assert pool.lookup(h(1), G0) is blocks[1] and pool.num_cached_blocks == 2


def test_touch_cached_free_block_leaves_queue() -> None:
    pool = make(6)
    blocks = pool.allocate(5)
    pool.cache_block(blocks[2], h(7), G1)
    pool.free(blocks)
    pool.check_integrity()
    assert queue(pool) == [3] and runs(pool) == [(1, 3), (4, 6)]
    hit = pool.lookup(h(7), G1)
    assert hit is blocks[2] and hit.ref_cnt == 0  # lookup changes nothing
    assert pool.lookup(h(7), G0) is None  # the group is part of the key
    pool.touch([hit])
    pool.check_integrity()
    assert hit.ref_cnt == 1 and hit.cache_key == (h(7), G1)
    assert queue(pool) == []
    assert pool.num_free_blocks == 4
    assert hit not in pool.allocate(4)
    pool.check_integrity()
    pool.free([hit])
    pool.check_integrity()
    assert queue(pool) == [3] and pool.lookup(h(7), G1) is hit


def test_touch_head_and_tail_of_queue() -> None:
    pool = make(8)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i), G0)
    pool.free(blocks)
    pool.touch([blocks[0]])
    pool.check_integrity()
    pool.touch([blocks[3]])
    pool.check_integrity()
    assert queue(pool) == [2, 3]
    assert ids(pool.allocate(5)) == [5, 6, 7, 2, 3]
    pool.check_integrity()


def test_touch_uncached_free_blocks_splits_runs() -> None:
    pool = make(8)
    for bid, left in ((1, [(2, 8)]), (7, [(2, 7)]), (4, [(2, 4), (5, 7)])):
        pool.touch([pool.get_block(BlockId(bid))])
        pool.check_integrity()
        assert runs(pool) == left
    pool.free([pool.get_block(BlockId(4))])
    pool.check_integrity()
    assert runs(pool) == [(2, 7)]


def test_ref_counts_with_two_owners() -> None:
    pool = make(6)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, h(1), G0)
    pool.touch([pool.lookup(h(1), G0)])  # a second request hits the prefix
    pool.check_integrity()
    assert blk.ref_cnt == 2
    pool.free([blk])
    pool.check_integrity()
    assert blk.ref_cnt == 1 and blk.block_id not in queue(pool)
    pool.free([blk])
    pool.check_integrity()
    assert blk.ref_cnt == 0 and queue(pool)[-1] == blk.block_id
    # Freeing the same block twice in one call is fine while references remain.
    pool.touch([blk, blk])
    pool.check_integrity()
    pool.free([blk, blk])
    pool.check_integrity()
    assert blk.ref_cnt == 0


def test_double_free_raises_and_changes_nothing() -> None:
    pool = make(6)
    a, b = pool.allocate(2)
    pool.free([b])
    before = snapshot(pool)
    with pytest.raises(IntegrityError, match="double free"):
        pool.free([a, b])
    assert snapshot(pool) == before and a.ref_cnt == 1
    with pytest.raises(IntegrityError, match="double free"):
        pool.free([a, a])
    assert snapshot(pool) == before
    pool.check_integrity()


def test_null_block_ignored() -> None:
    pool = make(4)
    null = pool.null_block
    before = snapshot(pool)
    pool.touch([null])
    pool.free([null, null])
    pool.check_integrity()
    assert snapshot(pool) == before and null.ref_cnt == 0
    blocks = pool.allocate(3)
    pool.touch([null, blocks[0]])
    pool.free([null, blocks[0]])
    pool.check_integrity()
    assert blocks[0].ref_cnt == 1
    with pytest.raises(ValueError):
        pool.cache_block(null, h(0), G0)
    pool.check_integrity()


def test_cache_block_requires_in_use_block() -> None:
    pool = make(4)
    free_block = pool.get_block(BlockId(1))
    with pytest.raises(ValueError):
        pool.cache_block(free_block, h(0), G0)
    pool.check_integrity()
    assert pool.num_cached_blocks == 0


def test_caching_disabled() -> None:
    pool = make(4, enable_caching=False)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], h(0), G0)
    pool.check_integrity()
    assert blocks[0].cache_key is None
    assert pool.lookup(h(0), G0) is None and pool.num_cached_blocks == 0
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    pool.check_integrity()


def test_first_writer_wins() -> None:
    pool = make(6)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1), G0)
    pool.cache_block(b, h(1), G0)  # key already held: b stays uncached
    pool.check_integrity()
    assert pool.lookup(h(1), G0) is a and b.cache_key is None
    pool.cache_block(a, h(2), G0)  # a block already cached keeps its key
    pool.check_integrity()
    assert a.cache_key == (h(1), G0) and pool.lookup(h(2), G0) is None
    pool.cache_block(b, h(1), G1)  # same hash, other group: a different key
    pool.check_integrity()
    assert pool.lookup(h(1), G1) is b and pool.num_cached_blocks == 2
    # Once a's key is evicted, the key is free for another writer.
    pool.free([a])
    pool.allocate(pool.num_free_blocks)
    pool.check_integrity()
    assert pool.lookup(h(1), G0) is None
    pool.cache_block(b, h(1), G0)  # b already cached under (h1, G1): left alone
    assert pool.lookup(h(1), G0) is None
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = make(6)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i), G0)
    pool.free(blocks[:2])
    before = snapshot(pool)
    assert not pool.reset_prefix_cache()  # blocks[2] still in use
    pool.check_integrity()
    assert snapshot(pool) == before
    pool.free(blocks[2:])
    assert pool.reset_prefix_cache()
    pool.check_integrity()
    assert pool.num_cached_blocks == 0 and queue(pool) == [] and runs(pool) == [(1, 6)]
    assert all(pool.lookup(h(i), G0) is None for i in range(3))
    assert all(b.cache_key is None for b in blocks)
    assert pool.reset_prefix_cache()  # nothing cached, nothing in use
    pool.check_integrity()


# -- check_integrity on corrupted state ------------------------------------------------------


def _corrupt_negative_ref(p: BlockPool) -> None:
    p.get_block(BlockId(4)).ref_cnt = -1


def _corrupt_queued_with_ref(p: BlockPool) -> None:
    p.get_block(BlockId(4)).ref_cnt = 1


def _corrupt_in_use_with_zero_ref(p: BlockPool) -> None:
    p.get_block(BlockId(1)).ref_cnt = 0


def _corrupt_dict_lost_key(p: BlockPool) -> None:
    del p._cache[(h(1), G0)]


def _corrupt_key_to_wrong_block(p: BlockPool) -> None:
    p._cache[(h(9), G0)] = p.get_block(BlockId(1))


def _corrupt_block_key_mismatch(p: BlockPool) -> None:
    p.get_block(BlockId(1)).cache_key = (h(9), G0)


def _corrupt_free_counter(p: BlockPool) -> None:
    p._num_free += 1


def _corrupt_queue_link(p: BlockPool) -> None:
    blk = p.get_block(BlockId(4))
    assert blk.next is not None
    blk.next.prev = None


def _corrupt_queue_cycle(p: BlockPool) -> None:
    blk = p.get_block(BlockId(5))
    blk.next = p.get_block(BlockId(4))


def _corrupt_null_ref(p: BlockPool) -> None:
    p.null_block.ref_cnt = 1


def _corrupt_disabled_cache(p: BlockPool) -> None:
    p.enable_caching = False


CORRUPTIONS: dict[str, tuple[Callable[[BlockPool], None], str, int | None]] = {
    "negative_ref": (_corrupt_negative_ref, "no negative ref count", 4),
    "queued_with_ref": (_corrupt_queued_with_ref, "free iff ref count 0", 4),
    "in_use_zero_ref": (_corrupt_in_use_with_zero_ref, "free iff ref count 0", 1),
    "dict_lost_key": (_corrupt_dict_lost_key, "reachable under its key", 1),
    "key_to_wrong_block": (_corrupt_key_to_wrong_block, "key maps to a block", 1),
    "block_key_mismatch": (_corrupt_block_key_mismatch, "reachable under its key", 1),
    "free_counter": (_corrupt_free_counter, "free counter", None),
    "queue_link": (_corrupt_queue_link, "free queue links", 4),
    "queue_cycle": (_corrupt_queue_cycle, "free queue links", 5),
    "null_ref": (_corrupt_null_ref, "null block", 0),
    "disabled_cache": (_corrupt_disabled_cache, "caching disabled", 1),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_check_integrity_detects_corruption(name: str) -> None:
    corrupt, invariant_name, block_id = CORRUPTIONS[name]
    pool = make(6)
    blocks = pool.allocate(5)  # ids 1, 2, 3 in use; 4, 5 cached free, in the queue
    for i in (0, 3, 4):
        pool.cache_block(blocks[i], h(i + 1), G0)
    pool.free(blocks[3:])
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(IntegrityError, match=invariant_name) as err:
        pool.check_integrity()
    if block_id is not None:
        assert f"(block {block_id})" in str(err.value)


def _split_run(p: BlockPool) -> None:  # [3, 9) filed as [3, 5) and [5, 9)
    p._unfile_run(3, 9)
    p._file_run(3, 5)
    p._file_run(5, 9)


def _overlapping_run(p: BlockPool) -> None:
    p._file_run(2, 4)


def _run_out_of_class(p: BlockPool) -> None:
    p._classes[2].discard(3)
    p._classes[0].add(3)


def _cached_block_in_run(p: BlockPool) -> None:
    p.get_block(BlockId(5)).cache_key = (h(9), G0)
    p._cache[(h(9), G0)] = p.get_block(BlockId(5))


def _run_end_index(p: BlockPool) -> None:
    p._run_start[8] = p._run_start.pop(9)


RUN_CORRUPTIONS: dict[str, tuple[Callable[[BlockPool], None], str, int | None]] = {
    "split": (_split_run, "runs maximal", 5),
    "overlap": (_overlapping_run, "runs disjoint", 3),
    "class": (_run_out_of_class, "run size classes", 3),
    "cached": (_cached_block_in_run, "queued iff cached", 5),
    "end_index": (_run_end_index, "run index", 3),
}


@pytest.mark.parametrize("name", sorted(RUN_CORRUPTIONS))
def test_check_integrity_detects_corrupt_runs(name: str) -> None:
    corrupt, invariant_name, block_id = RUN_CORRUPTIONS[name]
    pool = make(10)
    pool.allocate(2)  # ids 1, 2 in use; [3, 10) one run
    pool.touch([pool.get_block(BlockId(9))])  # [3, 9)
    assert runs(pool) == [(3, 9)]
    corrupt(pool)
    with pytest.raises(IntegrityError, match=invariant_name) as err:
        pool.check_integrity()
    if block_id is not None:
        assert f"(block {block_id})" in str(err.value)


# -- model-based tests ----------------------------------------------------------------------

KEYS = [(h(i), GroupId(i % 2)) for i in range(6)]


class PoolMachine(RuleBasedStateMachine):
    """Drives a pool against a model: ref counts, the free order and the key table."""

    @initialize(num_blocks=st.integers(2, 10), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.caching = caching
        self.refs = {i: 0 for i in range(1, num_blocks)}
        self.order: list[int] = []  # model LRU queue: cached free blocks
        self.plain = set(range(1, num_blocks))  # model uncached free blocks (any order)
        self.cache: dict[tuple[BlockHash, GroupId], int] = {}
        self.held: list[int] = []  # one entry per reference taken by the test

    def _key_of(self, bid: int) -> tuple[BlockHash, GroupId] | None:
        return next((k for k, v in self.cache.items() if v == bid), None)

    @rule(n=st.integers(0, 5))
    def allocate(self, n: int) -> None:
        if n > len(self.order) + len(self.plain):
            before = snapshot(self.pool)
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            assert snapshot(self.pool) == before
            return
        got = ids(self.pool.allocate(n))
        assert len(got) == len(set(got)) == n
        # Uncached blocks first, in any order; then cached ones, evicted in LRU order.
        evict = max(0, n - len(self.plain))
        assert set(got[: n - evict]) <= self.plain
        assert got[n - evict :] == sorted(self.order[:evict])
        self.plain -= set(got)
        del self.order[:evict]
        for bid in got:
            key = self._key_of(bid)
            if key is not None:
                del self.cache[key]
            self.refs[bid] = 1
        self.held += got

    @rule(key=st.sampled_from(KEYS))
    def touch_prefix_hit(self, key: tuple[BlockHash, GroupId]) -> None:
        blk = self.pool.lookup(*key)
        assert (blk.block_id if blk else None) == self.cache.get(key)
        if blk is not None:
            self._touch(blk.block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def touch_second_owner(self, data: st.DataObject) -> None:
        self._touch(data.draw(st.sampled_from(self.held)))

    def _touch(self, bid: int) -> None:
        self.pool.touch([self.pool.null_block, self.pool.get_block(BlockId(bid))])
        if self.refs[bid] == 0:
            if bid in self.plain:
                self.plain.remove(bid)
            else:
                self.order.remove(bid)
        self.refs[bid] += 1
        self.held.append(bid)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def cache(self, data: st.DataObject, key: tuple[BlockHash, GroupId]) -> None:
        bid = data.draw(st.sampled_from(self.held))
        self.pool.cache_block(self.pool.get_block(BlockId(bid)), *key)
        if self.caching and key not in self.cache and self._key_of(bid) is None:
            self.cache[key] = bid

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        idx = data.draw(st.lists(st.sampled_from(range(len(self.held))), unique=True))
        bids = [self.held[i] for i in idx]
        for i in sorted(idx, reverse=True):
            del self.held[i]
        self.pool.free([self.pool.get_block(BlockId(b)) for b in bids])
        for bid in bids:
            self.refs[bid] -= 1
            if self.refs[bid] == 0:
                if self._key_of(bid) is None:
                    self.plain.add(bid)
                else:
                    self.order.append(bid)

    @precondition(lambda self: self.order or self.plain)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        bid = data.draw(st.sampled_from(sorted(self.plain) + self.order))
        before = snapshot(self.pool)
        with pytest.raises(IntegrityError):
            self.pool.free([self.pool.get_block(BlockId(bid))])
        assert snapshot(self.pool) == before

    @rule()
    def reset(self) -> None:
        did = self.pool.reset_prefix_cache()
        assert did == (not self.held)
        if did:
            self.cache.clear()
            self.plain |= set(self.order)
            self.order = []

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_integrity()
        pool = self.pool
        assert free_ids(pool) == {b for b, r in self.refs.items() if r == 0}
        assert queue(pool) == self.order
        assert {b for s, e in runs(pool) for b in range(s, e)} == self.plain
        assert {b: pool.get_block(BlockId(b)).ref_cnt for b in self.refs} == self.refs
        assert pool.num_free_blocks == len(self.order) + len(self.plain)
        assert pool.num_cached_blocks == len(self.cache)
        for key in KEYS:
            blk = pool.lookup(*key)
            assert (blk.block_id if blk else None) == self.cache.get(key)
        assert pool.null_block.ref_cnt == 0


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


@pytest.mark.parametrize("seed", range(5))
def test_randomized_large_pool(seed: int) -> None:
    """~100 blocks, integrity checked after every operation; ref model checked throughout."""
    rng = random.Random(seed)
    pool = BlockPool(100)
    expected = {i: 0 for i in range(1, 100)}
    held: list[KVBlock] = []
    for _ in range(1500):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(0, 8)
            if pool.can_allocate(n):
                new = pool.allocate(n)
                held += new
                for b in new:
                    expected[b.block_id] = 1
        elif op < 0.45:
            blk = pool.lookup(h(rng.randrange(40)), G0)
            if blk is not None:
                pool.touch([blk])
                held.append(blk)
                expected[blk.block_id] += 1
        elif op < 0.65 and held:
            pool.cache_block(rng.choice(held), h(rng.randrange(40)), G0)
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, min(4, len(held)))
            gone, held = held[:k], held[k:]
            pool.free(gone)
            for b in gone:
                expected[b.block_id] -= 1
        pool.check_integrity()
        assert free_ids(pool) == {b for b, r in expected.items() if r == 0}
