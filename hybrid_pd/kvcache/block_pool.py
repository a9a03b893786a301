"""Block pool: ids, ref counts, free runs, the LRU queue of cached blocks and the prefix cache.

    block id:   0      1  2  3  4  5 ...  N-1
                null   ---- allocatable ------
    free runs:  [2, 5) [9, 10) ...        uncached free blocks, as maximal runs of ids
    LRU queue:  head (evict first) <-> ... <-> tail (freed last)    cached free blocks

A free block (ref count 0) is either *uncached*, and then sits in a run of consecutive free
uncached ids, or *cached*: it carries a (block hash, group id) key, sits in the LRU queue and
is found by prefix lookups until it is evicted (popped for reuse, key dropped). `allocate`
hands out uncached blocks first, as few runs as it can find, and evicts cached blocks only
when those run out, in LRU order. Consecutive ids matter: a KV transfer moves one message
per run of ids that are consecutive on both workers. The null block (id 0) is never
allocated or freed.

Invariants (checked by `check_integrity`):
  * free + in use == num_blocks - 1 (the null block is neither)
  * a block is free iff its ref count is 0; a free block is queued iff it is cached and
    in a run iff it is not; no ref count is negative;
  * runs are disjoint, maximal (no two touch) and filed under their length's size class;
  * every cached block is reachable under its key and every key maps to a block carrying it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NoReturn

from hybrid_pd.kvcache.hashing import BlockHash
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID, BlockId, GroupId


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when fewer free blocks exist than requested (nothing changes)."""


class IntegrityError(AssertionError):
    """A pool invariant does not hold."""


class KVBlock:
    """One block's metadata."""

    __slots__ = ("block_id", "cache_key", "next", "prev", "ref_cnt")

    def __init__(self, block_id: BlockId) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: tuple[BlockHash, GroupId] | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.cache_key is not None})"


class BlockPool:
    """Owns every block of one worker's pool (see the module docstring)."""

    null_block: KVBlock

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        """`num_blocks` includes the null block; at least 2."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (null block included): {num_blocks}")
        self.enable_caching = enable_caching
        #: Called with the ids of the blocks `free` is about to release, before any of them
        #: can change owner (KVPool writes the states it holds for them).
        self.before_free: Callable[[list[int]], None] | None = None
        self._blocks = [KVBlock(BlockId(i)) for i in range(num_blocks)]
        self.null_block = self._blocks[NULL_BLOCK_ID]
        self._cache: dict[tuple[BlockHash, GroupId], KVBlock] = {}
        # Sentinels (id -1, never in the table): head.next is evicted first, tail.prev last.
        self._head = KVBlock(BlockId(-1))
        self._tail = KVBlock(BlockId(-1))
        self._head.next, self._tail.prev = self._tail, self._head
        # Free uncached runs [start, end): end by start, start by end, and the starts filed
        # by size class (length.bit_length() - 1) so a long enough run is found quickly.
        self._run_end: dict[int, int] = {}
        self._run_start: dict[int, int] = {}
        self._classes: list[set[int]] = [set() for _ in range(num_blocks.bit_length())]
        self._num_free = num_blocks - 1
        self._file_run(1, num_blocks)

    # -- LRU queue of cached free blocks ----------------------------------------------------

    def _push_tail(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self._num_free += 1

    def _unlink(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} not queued"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._num_free -= 1

    def _free_queue_ids(self) -> list[BlockId]:
        """Ids of cached free blocks, head (evict first) to tail. For tests and debugging."""
        ids: list[BlockId] = []
        node = self._head.next
        while node is not None and node is not self._tail and len(ids) < len(self._blocks):
            ids.append(node.block_id)
            node = node.next
        return ids

    # -- runs of uncached free blocks -------------------------------------------------------

    def _file_run(self, start: int, end: int) -> None:
        self._run_end[start] = end
        self._run_start[end] = start
        self._classes[(end - start).bit_length() - 1].add(start)

    def _unfile_run(self, start: int, end: int) -> None:
        del self._run_end[start]
        del self._run_start[end]
        self._classes[(end - start).bit_length() - 1].discard(start)

    def _release_ids(self, start: int, end: int) -> None:
        """Ids [start, end), just freed and uncached, join the runs (merged with neighbours).
        The caller counts them as free."""
        left = self._run_start.get(start)
        if left is not None:
            self._unfile_run(left, start)
            start = left
        right = self._run_end.get(end)
        if right is not None:
            self._unfile_run(end, right)
            end = right
        self._file_run(start, end)

    def _claim_id(self, bid: int) -> None:
        """Take one uncached free block out of its run (splitting it)."""
        start = bid
        while start not in self._run_end:  # walk back to the run's start
            start -= 1
        end = self._run_end[start]
        self._unfile_run(start, end)
        if start < bid:
            self._file_run(start, bid)
        if bid + 1 < end:
            self._file_run(bid + 1, end)
        self._num_free -= 1

    def _pop_run(self, n: int) -> tuple[int, int]:
        """Unfile and return the run to cut up to `n` blocks from: one of the first few of
        n's size class that holds n, else any run of a larger class, else the longest run
        of a smaller one. Uses `set.pop`, whose cost stays flat as a class shrinks."""
        classes, run_end = self._classes, self._run_end
        k = n.bit_length() - 1
        same = classes[k]
        tried: list[int] = []
        found = None
        while same and len(tried) < 8:
            start = same.pop()
            if run_end[start] - start >= n:
                found = start
                break
            tried.append(start)
        same.update(tried)
        if found is None:
            for j in range(k + 1, len(classes)):
                if classes[j]:
                    found = classes[j].pop()
                    break
        if found is None:  # nothing holds n: the longest of the few we look at
            top = classes[max(i for i in range(k + 1) if classes[i])]
            tried = [top.pop() for _ in range(min(8, len(top)))]
            found = max(tried, key=lambda s: run_end[s] - s)
            tried.remove(found)
            top.update(tried)
        end = run_end[found]
        self._unfile_run(found, end)
        return found, end

    def _free_run_ids(self) -> list[tuple[int, int]]:
        """Free uncached runs [start, end) by start. For tests and debugging."""
        return sorted(self._run_end.items())

    # -- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached-free included): what `allocate` may hand out."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def usage(self) -> float:
        """Fraction of allocatable blocks in use (ref count > 0)."""
        allocatable = len(self._blocks) - 1
        return (allocatable - self._num_free) / allocatable

    def get_block(self, block_id: BlockId) -> KVBlock:
        if not 0 <= block_id < len(self._blocks):
            raise IndexError(f"block id {block_id} out of range [0, {len(self._blocks)})")
        return self._blocks[block_id]

    def lookup(self, block_hash: BlockHash, group_id: GroupId) -> KVBlock | None:
        """The cached block for this key, or None. Query only: no ref count changes."""
        return self._cache.get((block_hash, group_id))

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._num_free

    # -- mutations -----------------------------------------------------------------------

    def allocate(self, n: int) -> list[KVBlock]:
        """`n` blocks, ref count 1 each: uncached free blocks first, cut from as few runs as
        it finds (each run's blocks in id order); then, only if those run out, cached ones
        evicted in LRU order (their keys dropped), handed out in id order."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self._num_free:
            raise NoFreeBlocksError(f"requested {n} blocks, {self._num_free} free")
        out: list[KVBlock] = []
        need = n
        while need and self._run_end:
            start, end = self._pop_run(need)
            take = min(need, end - start)
            if start + take < end:
                self._file_run(start + take, end)
            piece = self._blocks[start : start + take]
            for block in piece:
                block.ref_cnt = 1
            out += piece
            need -= take
            self._num_free -= take
        if need:
            evicted = []
            for _ in range(need):
                block = self._head.next
                assert block is not None and block is not self._tail
                self._unlink(block)
                del self._cache[block.cache_key]  # type: ignore[arg-type]
                block.cache_key = None
                block.ref_cnt = 1
                evicted.append(block)
            evicted.sort(key=_by_id)
            out += evicted
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix hit); a free one stops being free.
        The null block is ignored."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                if block.cache_key is not None:
                    self._unlink(block)
                else:
                    self._claim_id(block.block_id)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group_id: GroupId) -> None:
        """Register a full, in-use block under (hash, group). A key already held by another
        block is left alone (first writer wins); a block already cached is left alone."""
        if not self.enable_caching or block.cache_key is not None:
            return
        if block.is_null or block.ref_cnt <= 0:
            raise ValueError(f"only an in-use, non-null block can be cached: {block!r}")
        key = (block_hash, group_id)
        if key not in self._cache:
            self._cache[key] = block
            block.cache_key = key

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in order. Cached blocks reaching 0 go to the
        LRU tail in that order (so pass the ones to evict first first); uncached ones join
        the free runs. Null block ignored. Raises IntegrityError on a block whose ref count
        is already 0."""
        todo = [b for b in blocks if not b.is_null]
        # Validate the whole call first so a double free changes nothing.
        drops: dict[int, int] = {}
        for block in todo:
            drops[id(block)] = drops.get(id(block), 0) + 1
            if drops[id(block)] > block.ref_cnt:
                raise IntegrityError(
                    f"double free: block {block.block_id} (ref count {block.ref_cnt}) freed "
                    f"{drops[id(block)]} times"
                )
        if todo and self.before_free is not None:
            self.before_free([b.block_id for b in todo])
        plain: list[int] = []
        for block in todo:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.cache_key is not None:
                    self._push_tail(block)
                else:
                    plain.append(block.block_id)
        if plain:
            plain.sort()
            self._num_free += len(plain)
            start = prev = plain[0]
            for bid in plain[1:]:
                if bid != prev + 1:
                    self._release_ids(start, prev + 1)
                    start = bid
                prev = bid
            self._release_ids(start, prev + 1)

    def reset_prefix_cache(self) -> bool:
        """Drop every cache key if no block is in use; returns whether it did. Every
        block is then one free run."""
        if self._num_free != len(self._blocks) - 1:
            return False
        for block in self._cache.values():
            block.cache_key = None
            block.prev = block.next = None
        self._cache.clear()
        self._head.next, self._tail.prev = self._tail, self._head
        self._run_end.clear()
        self._run_start.clear()
        for size_class in self._classes:
            size_class.clear()
        self._file_run(1, len(self._blocks))
        return True

    # -- integrity -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError naming the first invariant that does not hold."""

        def fail(invariant: str, block_id: int | None, detail: str) -> NoReturn:
            where = "" if block_id is None else f" (block {block_id})"
            raise IntegrityError(f"invariant '{invariant}' violated{where}: {detail}")

        n = len(self._blocks)
        # Walk the queue, checking links, membership and absence of cycles.
        queued: set[int] = set()
        prev, node = self._head, self._head.next
        while node is not self._tail:
            if node is None or node.prev is not prev:
                fail("free queue links", prev.block_id, "broken prev/next link")
            bid = node.block_id
            if not 0 <= bid < n or self._blocks[bid] is not node:
                fail("free queue links", bid, "queued block is not in the block table")
            if bid in queued:
                fail("free queue links", bid, "block queued twice (cycle)")
            if node.is_null:
                fail("null block never free", bid, "null block in the free queue")
            if node.cache_key is None:
                fail("queued iff cached", bid, "uncached block in the LRU queue")
            queued.add(bid)
            prev, node = node, node.next
        if self._tail.prev is not prev:
            fail("free queue links", prev.block_id, "tail.prev is not the last queued block")
        # Walk the runs: bounds, both indexes, size classes, maximal and disjoint.
        in_runs: set[int] = set()
        if len(self._run_start) != len(self._run_end):
            fail("run index", None, "start and end indexes differ in size")
        if sum(len(c) for c in self._classes) != len(self._run_end):
            fail("run size classes", None, "classes do not hold exactly the runs")
        for start, end in self._run_end.items():
            if not 1 <= start < end <= n:
                fail("run bounds", start, f"run [{start}, {end}) outside [1, {n})")
            if self._run_start.get(end) != start:
                fail("run index", start, f"run [{start}, {end}) missing from the end index")
            if start not in self._classes[(end - start).bit_length() - 1]:
                fail("run size classes", start, f"run [{start}, {end}) not in its class")
            if start in self._run_start:
                fail("runs maximal", start, f"run [{start}, {end}) touches the one before")
            for bid in range(start, end):
                if bid in in_runs or bid in queued:
                    fail("runs disjoint", bid, "block free twice")
                block = self._blocks[bid]
                if block.cache_key is not None:
                    fail("queued iff cached", bid, "cached block in a free run")
                if block.prev is not None or block.next is not None:
                    fail("free queue links", bid, "block in a run keeps queue links")
                in_runs.add(bid)
        if len(queued) + len(in_runs) != self._num_free:
            fail(
                "free counter",
                None,
                f"{len(queued)} queued + {len(in_runs)} in runs, counter says {self._num_free}",
            )
        # Walk the table: ref counts, free membership, cache keys.
        in_use = 0
        for block in self._blocks:
            bid = block.block_id
            if block.ref_cnt < 0:
                fail("no negative ref count", bid, f"ref count {block.ref_cnt}")
            if block.is_null:
                if block.ref_cnt or block.cache_key or block.prev or block.next:
                    fail("null block never allocated", bid, repr(block))
                continue
            free = bid in queued or bid in in_runs
            if (block.ref_cnt == 0) != free:
                fail("free iff ref count 0", bid, f"ref {block.ref_cnt}, free {free}")
            if bid not in queued and (block.prev is not None or block.next is not None):
                fail("free queue links", bid, "block outside the queue keeps links")
            in_use += block.ref_cnt > 0
            key = block.cache_key
            if key is not None:
                if not self.enable_caching:
                    fail("caching disabled", bid, f"block carries key {key!r}")
                if self._cache.get(key) is not block:
                    fail("cached block reachable under its key", bid, f"key {key!r}")
        if len(queued) + len(in_runs) + in_use != n - 1:
            fail(
                "free + in use == num_blocks - 1",
                None,
                f"{len(queued) + len(in_runs)} + {in_use} != {n - 1}",
            )
        for key, block in self._cache.items():
            bid = block.block_id
            if block.cache_key != key or not 0 <= bid < n or self._blocks[bid] is not block:
                fail("key maps to a block carrying it", bid, f"key {key!r}")


def _by_id(block: KVBlock) -> int:
    return block.block_id
