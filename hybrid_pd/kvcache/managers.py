"""Per-type managers: how one KV cache group allocates, skips and hits the prefix cache.

A manager owns, per request, the list of blocks of its group. For attention groups index i
holds token positions [i*B, (i+1)*B); positions no query will read again point at the null
block. For a state group the list holds the `blocks_per_state` pages of the current state.

Managers only decide; the `BlockPool` does the bookkeeping. Query methods never mutate.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid_pd.kvcache.block_pool import BlockPool, KVBlock
from hybrid_pd.kvcache.config import KVCacheGroup
from hybrid_pd.kvcache.hashing import BlockHash
from hybrid_pd.kvcache.ids import GroupId, RequestId
from hybrid_pd.kvcache.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    SlidingWindowSpec,
    StateSpec,
    cdiv,
)


class GroupManager:
    """Shared machinery of all attention-type managers."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool, block_size: int) -> None:
        self.group = group
        self.group_id = GroupId(group.group_id)
        self.pool = pool
        self.block_size = block_size
        self.req_blocks: dict[RequestId, list[KVBlock]] = {}
        #: The same lists as block ids, kept in step so the engine reads them without a copy.
        self.req_ids: dict[RequestId, list[int]] = {}
        #: Number of leading blocks of each request already registered in the prefix cache.
        self.num_cached: dict[RequestId, int] = {}

    # -- the per-request lists (every change goes through these) --------------------------
    def _set(self, rid: RequestId, blocks: list[KVBlock]) -> None:
        self.req_blocks[rid] = blocks
        self.req_ids[rid] = [int(b.block_id) for b in blocks]

    def _extend(self, rid: RequestId, blocks: list[KVBlock]) -> None:
        self.req_blocks.setdefault(rid, []).extend(blocks)
        self.req_ids.setdefault(rid, []).extend(int(b.block_id) for b in blocks)

    def _pop(self, rid: RequestId) -> list[KVBlock]:
        self.req_ids.pop(rid, None)
        return self.req_blocks.pop(rid, [])

    # -- queries ---------------------------------------------------------------------------
    def blocks(self, rid: RequestId) -> list[KVBlock]:
        return self.req_blocks.get(rid, [])

    def block_ids(self, rid: RequestId) -> list[int]:
        """The request's block ids (live list: read it, do not keep or change it)."""
        return self.req_ids.get(rid, [])

    def hit_blocks(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[KVBlock] | None:
        """Blocks a request would take for a prefix hit of `num_blocks` blocks, or None if the
        hit is not valid for this group (null blocks stand for positions it need not keep)."""
        out: list[KVBlock] = []
        first = self.first_needed_block(num_blocks * self.block_size)
        for i in range(num_blocks):
            if i < first:
                out.append(self.pool.null_block)
                continue
            block = self.pool.lookup(hashes[i], self.group_id)
            if block is None:
                return None
            out.append(block)
        return out

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        """Largest h <= max_blocks for which `hit_blocks(hashes, h)` is valid (0 always is):
        the blocks [first needed block at h, h) must all be cached. One pass, O(max_blocks)."""
        run = [0] * max_blocks  # run[i]: consecutive cached blocks ending at block i
        for i in range(max_blocks):
            if self.pool.lookup(hashes[i], self.group_id) is not None:
                run[i] = run[i - 1] + 1 if i else 1
        for h in range(max_blocks, 0, -1):
            if run[h - 1] >= h - self.first_needed_block(h * self.block_size):
                return h
        return 0

    def first_needed_block(self, num_computed: int) -> int:
        return self.group.spec.first_needed_token(num_computed) // self.block_size

    def num_new_blocks(self, rid: RequestId, num_tokens: int, num_hit: int = 0) -> int:
        """Blocks to allocate so the request holds slots for `num_tokens` tokens."""
        held = len(self.req_blocks.get(rid, ())) or num_hit
        return max(0, cdiv(num_tokens, self.block_size) - held)

    # -- mutations -------------------------------------------------------------------------
    def take_hit(self, rid: RequestId, blocks: list[KVBlock]) -> None:
        self.pool.touch(blocks)
        self._set(rid, list(blocks))
        self.num_cached[rid] = len(blocks)

    def release_skipped(self, rid: RequestId, num_computed: int) -> None:
        """Point blocks no future query reads at the null block and free them."""
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        ids = self.req_ids[rid]
        first = min(self.first_needed_block(num_computed), len(blocks))
        dropped = []
        for i in range(first - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was released earlier
            dropped.append(blocks[i])
            blocks[i] = self.pool.null_block
            ids[i] = int(self.pool.null_block.block_id)
        self.pool.free(dropped)

    def allocate(self, rid: RequestId, num_tokens: int) -> None:
        n = self.num_new_blocks(rid, num_tokens)
        self._extend(rid, self.pool.allocate(n))

    def num_tail_blocks(self, num_tokens: int) -> int:
        """Blocks a request needs to continue after `num_tokens` computed elsewhere."""
        return self.group.blocks_needed(num_tokens, self.block_size)

    def local_hit(self, hashes: Sequence[BlockHash], num_tokens: int) -> list[KVBlock]:
        """For a request whose first `num_tokens` tokens arrive from elsewhere: the cached
        blocks this pool already holds for the leading positions it must keep (from the
        first needed block on, whole blocks of those tokens only, up to the first miss).
        They need not be transferred. Query only."""
        out: list[KVBlock] = []
        full = min(num_tokens // self.block_size, len(hashes))
        for i in range(self.first_needed_block(num_tokens), full):
            block = self.pool.lookup(hashes[i], self.group_id)
            if block is None:
                break
            out.append(block)
        return out

    def allocate_tail(self, rid: RequestId, num_tokens: int, held: Sequence[KVBlock] = ()) -> None:
        """Blocks for a request whose first `num_tokens` tokens arrive from elsewhere: the
        null block for positions no future query reads, then `held` (a `local_hit` the
        caller already took references on), then fresh blocks for the rest."""
        first = self.first_needed_block(num_tokens)
        fresh = self.pool.allocate(self.num_tail_blocks(num_tokens) - len(held))
        self._set(rid, [self.pool.null_block] * first + list(held) + fresh)
        if held:
            self.num_cached[rid] = first + len(held)

    def cache_computed(
        self, rid: RequestId, hashes: Sequence[BlockHash], num_computed: int
    ) -> None:
        """Register blocks whose tokens are all computed under their prefix hashes."""
        blocks = self.req_blocks.get(rid, [])
        full = min(num_computed // self.block_size, len(hashes), len(blocks))
        start = self.num_cached.get(rid, 0)
        for i in range(start, full):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], hashes[i], self.group_id)
        self.num_cached[rid] = max(start, full)

    def free(self, rid: RequestId, hashes: Sequence[BlockHash], num_computed: int) -> None:
        """Free every block of the request, tail first (the tail is evicted first)."""
        blocks = self._pop(rid)
        self.num_cached.pop(rid, None)
        self.pool.free(reversed(blocks))


class FullAttentionManager(GroupManager):
    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        # Full attention needs every block: scan left to right, stop at the first miss.
        for i in range(max_blocks):
            if self.pool.lookup(hashes[i], self.group_id) is None:
                return i
        return max_blocks


class SlidingWindowManager(GroupManager):
    pass


class ChunkedLocalManager(GroupManager):
    pass


class StateManager(GroupManager):
    """One state per layer per request, `blocks_per_state` pages each.

    The state is updated in place, so a page is valid for a prefix hit only as a *snapshot*
    of exactly `h * block_size` tokens. Snapshots are taken when a request finishes on a
    block boundary, by `snapshot` (a chunk that ended on one), and in pages a step writes on
    its way past one (`reserve_snapshot`, then `commit_snapshot`). A hit never shares the
    snapshot page: the request gets fresh pages and a pending copy (snapshot -> fresh) that
    the engine runs before its step.
    """

    def __init__(self, group: KVCacheGroup, pool: BlockPool, block_size: int) -> None:
        super().__init__(group, pool, block_size)
        self.span = group.blocks_per_state
        #: Pending (source blocks, destination blocks) copies, sources held by one reference.
        self.pending_copies: dict[RequestId, tuple[list[KVBlock], list[KVBlock]]] = {}
        #: Pages a step writes a request's state into at a block boundary inside its chunk
        #: (`reserve_snapshot`): (number of blocks, pages), cached by `commit_snapshot`.
        self.reserved: dict[RequestId, tuple[int, list[KVBlock]]] = {}

    def snapshot_blocks(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[KVBlock]:
        """The cached snapshot for a prefix of `num_blocks` blocks, or [] if there is none."""
        if num_blocks == 0:
            return []
        out = []
        for j in range(self.span):
            block = self.pool.lookup(_shard_hash(hashes[num_blocks - 1], j), self.group_id)
            if block is None:
                return []
            out.append(block)
        return out

    def hit_blocks(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[KVBlock] | None:
        if num_blocks == 0:
            return []
        return self.snapshot_blocks(hashes, num_blocks) or None

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> int:
        for h in range(max_blocks, 0, -1):
            if self.snapshot_blocks(hashes, h):
                return h
        return 0

    def num_new_blocks(self, rid: RequestId, num_tokens: int, num_hit: int = 0) -> int:
        if num_tokens <= 0 or rid in self.req_blocks:
            return 0
        return self.span

    def take_hit(self, rid: RequestId, blocks: list[KVBlock]) -> None:
        # Only take the reference here: the fresh pages come from `allocate`, after every
        # group took its hit. Allocating now could evict (and hand this group) a cached
        # block another group's hit has not touched yet.
        if not blocks:
            return
        self.pool.touch(blocks)
        self.pending_copies[rid] = (list(blocks), [])

    def release_skipped(self, rid: RequestId, num_computed: int) -> None:
        return None  # the state is always needed

    def local_hit(self, hashes: Sequence[BlockHash], num_tokens: int) -> list[KVBlock]:
        return []  # the state at the end of the prompt always comes with the prompt

    def allocate_tail(self, rid: RequestId, num_tokens: int, held: Sequence[KVBlock] = ()) -> None:
        self._set(rid, self.pool.allocate(self.span))

    def allocate(self, rid: RequestId, num_tokens: int) -> None:
        if self.num_new_blocks(rid, num_tokens):
            fresh = self.pool.allocate(self.span)
            self._set(rid, fresh)
            pending = self.pending_copies.get(rid)
            if pending is not None and not pending[1]:  # hit taken: copy snapshot -> fresh
                self.pending_copies[rid] = (pending[0], fresh)

    def take_copies(self, rid: RequestId) -> tuple[list[KVBlock], list[KVBlock]] | None:
        return self.pending_copies.get(rid)

    def finish_copies(self, rid: RequestId) -> None:
        """The engine copied the snapshot: drop the reference held on the source pages."""
        src_dst = self.pending_copies.pop(rid, None)
        if src_dst is not None:
            self.pool.free(src_dst[0])

    def cache_computed(
        self, rid: RequestId, hashes: Sequence[BlockHash], num_computed: int
    ) -> None:
        return None  # only whole-request snapshots are cached, see `free` and `snapshot`

    def snapshot(self, rid: RequestId, hashes: Sequence[BlockHash], num_computed: int) -> bool:
        """Keep the current state as the snapshot for `num_computed` tokens and move the
        request onto fresh pages (with a pending copy current -> fresh). Returns False, and
        changes nothing, when `num_computed` is not on a block boundary, the pool has no
        room, or a snapshot already exists."""
        h = num_computed // self.block_size
        blocks = self.req_blocks.get(rid)
        if (
            not blocks
            or num_computed % self.block_size
            or h == 0
            or h > len(hashes)
            or rid in self.pending_copies
            or self.snapshot_blocks(hashes, h)
            or not self.pool.can_allocate(self.span)
        ):
            return False
        for j, block in enumerate(blocks):
            self.pool.cache_block(block, _shard_hash(hashes[h - 1], j), self.group_id)
        fresh = self.pool.allocate(self.span)
        self.pending_copies[rid] = (blocks, fresh)
        self._set(rid, fresh)
        return True

    def reserve_snapshot(
        self, rid: RequestId, hashes: Sequence[BlockHash], h: int
    ) -> list[int] | None:
        """Fresh pages for the request's state after `h` blocks, which its next step passes
        inside a chunk (the step writes the state there on its way); [] when that snapshot
        is cached already (nothing to keep); None, changing nothing, when the pool has no
        room or there is no such snapshot to keep (`h` is 0 or past the hashes, or one is
        reserved already)."""
        if rid not in self.req_blocks or h == 0 or h > len(hashes) or rid in self.reserved:
            return None
        if self.snapshot_blocks(hashes, h):
            return []
        if not self.pool.can_allocate(self.span):
            return None
        blocks = self.pool.allocate(self.span)
        self.reserved[rid] = (h, blocks)
        return [int(b.block_id) for b in blocks]

    def commit_snapshot(self, rid: RequestId, hashes: Sequence[BlockHash]) -> None:
        """The step wrote the reserved pages (if any): they become the prefix cache's
        snapshot."""
        reserved = self.reserved.pop(rid, None)
        if reserved is None:
            return
        h, blocks = reserved
        if not self.snapshot_blocks(hashes, h):  # another request's may have landed first
            for j, block in enumerate(blocks):
                self.pool.cache_block(block, _shard_hash(hashes[h - 1], j), self.group_id)
        self.pool.free(blocks)

    def drop_reserved(self, rid: RequestId) -> None:
        reserved = self.reserved.pop(rid, None)
        if reserved is not None:
            self.pool.free(reserved[1])

    def free(self, rid: RequestId, hashes: Sequence[BlockHash], num_computed: int) -> None:
        self.finish_copies(rid)
        self.drop_reserved(rid)
        blocks = self._pop(rid)
        h = num_computed // self.block_size
        if blocks and num_computed % self.block_size == 0 and 0 < h <= len(hashes):
            if not self.snapshot_blocks(hashes, h):
                for j, block in enumerate(blocks):
                    self.pool.cache_block(block, _shard_hash(hashes[h - 1], j), self.group_id)
        self.pool.free(blocks)


def _shard_hash(block_hash: BlockHash, shard: int) -> BlockHash:
    return block_hash if shard == 0 else BlockHash(block_hash + bytes([shard]))


#: Manager class per spec type.
MANAGER_FOR_SPEC: dict[type[LayerSpec], type[GroupManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
    StateSpec: StateManager,
}


def make_manager(group: KVCacheGroup, pool: BlockPool, block_size: int) -> GroupManager:
    try:
        cls = MANAGER_FOR_SPEC[type(group.spec)]
    except KeyError:
        raise TypeError(f"no manager for spec type {type(group.spec).__name__}") from None
    return cls(group, pool, block_size)
