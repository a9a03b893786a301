"""Block pool: ids, ref counts, the LRU free queue and the prefix cache.

    block id:   0      1  2  3  4  5 ...  N-1
                null   ---- allocatable ------
    free queue: head (evict first) <-> ... <-> tail (freed last)

Blocks with ref count 0 sit in the free queue. A free block may still be *cached*: it carries
a (block hash, group id) key and is found by prefix lookups until it is popped for reuse, at
which point its key is dropped (eviction). The null block (id 0) is never allocated or freed.

Invariants (checked by `check_integrity`):
  * free + in use == num_blocks - 1 (the null block is neither)
  * cached-free blocks are a subset of the free queue;
  * no ref count is negative; a block is in the free queue iff its ref count is 0;
  * every cached block is reachable under its key and every key maps to a block carrying it.
"""

from __future__ import annotations

from collections.abc import Iterable
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
        self._blocks = [KVBlock(BlockId(i)) for i in range(num_blocks)]
        self.null_block = self._blocks[NULL_BLOCK_ID]
        self._cache: dict[tuple[BlockHash, GroupId], KVBlock] = {}
        # Sentinels (id -1, never in the table): head.next is evicted first, tail.prev last.
        self._head = KVBlock(BlockId(-1))
        self._tail = KVBlock(BlockId(-1))
        self._head.next, self._tail.prev = self._tail, self._head
        self._num_free = 0
        for block in self._blocks[1:]:
            self._push_tail(block)

    # -- intrusive free queue ------------------------------------------------------------

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
        """Ids in the free queue, head (evict first) to tail. For tests and debugging."""
        ids: list[BlockId] = []
        node = self._head.next
        while node is not None and node is not self._tail and len(ids) < len(self._blocks):
            ids.append(node.block_id)
            node = node.next
        return ids

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
        """Pop `n` blocks from the queue head (evicting their cache keys), ref count 1 each."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self._num_free:
            raise NoFreeBlocksError(f"requested {n} blocks, {self._num_free} free")
        out: list[KVBlock] = []
        for _ in range(n):
            block = self._head.next
            assert block is not None and block is not self._tail
            self._unlink(block)
            if block.cache_key is not None:
                del self._cache[block.cache_key]
                block.cache_key = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix hit); a free one leaves the queue.
        The null block is ignored."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self._unlink(block)
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
        """Drop one reference from each block, in order; blocks reaching 0 go to the queue
        tail in that order (so pass the ones to evict first first). Null block ignored.
        Raises IntegrityError on a block whose ref count is already 0."""
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
        for block in todo:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._push_tail(block)

    def reset_prefix_cache(self) -> bool:
        """Drop every cache key if no block is in use; returns whether it did."""
        if self._num_free != len(self._blocks) - 1:
            return False
        for block in self._cache.values():
            block.cache_key = None
        self._cache.clear()
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
            queued.add(bid)
            prev, node = node, node.next
        if self._tail.prev is not prev:
            fail("free queue links", prev.block_id, "tail.prev is not the last queued block")
        if len(queued) != self._num_free:
            fail("free counter", None, f"{len(queued)} queued, counter says {self._num_free}")
        # Walk the table: ref counts, queue membership, cache keys.
        in_use = 0
        for block in self._blocks:
            bid = block.block_id
            if block.ref_cnt < 0:
                fail("no negative ref count", bid, f"ref count {block.ref_cnt}")
            if block.is_null:
                if block.ref_cnt or block.cache_key or block.prev or block.next:
                    fail("null block never allocated", bid, repr(block))
                continue
            if (block.ref_cnt == 0) != (bid in queued):
                fail("free iff ref count 0", bid, f"ref {block.ref_cnt}, queued {bid in queued}")
            if bid not in queued and (block.prev is not None or block.next is not None):
                fail("free queue links", bid, "block outside the queue keeps links")
            in_use += block.ref_cnt > 0
            key = block.cache_key
            if key is not None:
                if not self.enable_caching:
                    fail("caching disabled", bid, f"block carries key {key!r}")
                if self._cache.get(key) is not block:
                    fail("cached block reachable under its key", bid, f"key {key!r}")
        # "cached-free blocks are a subset of the free queue" follows from "free iff ref 0".
        if len(queued) + in_use != n - 1:
            fail("free + in use == num_blocks - 1", None, f"{len(queued)} + {in_use} != {n - 1}")
        for key, block in self._cache.items():
            bid = block.block_id
            if block.cache_key != key or not 0 <= bid < n or self._blocks[bid] is not block:
                fail("key maps to a block carrying it", bid, f"key {key!r}")
