"""KVCacheManager: the scheduler's single entry point to the hybrid KV cache.

    scheduler ──► KVCacheManager (this file: per-request records, prefix-hit intersection)
                      ├── GroupManager per KV cache group (managers.py)
                      └── BlockPool (block_pool.py)

A request's life: `find_prefix_hit` (query) → `allocate_slots` (reserve slots for the
tokens of the next step; returns None and changes nothing when the pool is short) → the
engine computes → `commit_computed` (register full blocks in the prefix cache) → ... →
`free` (finish, abort or preemption).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybrid_pd.kvcache.block_pool import BlockPool, IntegrityError, KVBlock
from hybrid_pd.kvcache.config import KVCacheConfig
from hybrid_pd.kvcache.hashing import BlockHash, hash_block
from hybrid_pd.kvcache.ids import BlockId, RequestId
from hybrid_pd.kvcache.managers import GroupManager, StateManager, make_manager

BlockIds = tuple[list[int], ...]


@dataclass(frozen=True)
class PrefixHit:
    """Result of a prefix lookup: `num_tokens` cached tokens and, per group, the blocks."""

    num_tokens: int
    blocks: tuple[list[KVBlock], ...]

    @property
    def num_blocks_to_take(self) -> int:
        return sum(1 for bl in self.blocks for b in bl if not b.is_null and b.ref_cnt == 0)


@dataclass
class _Record:
    token_ids: list[int]
    hashes: list[BlockHash] = field(default_factory=list)
    num_computed: int = 0
    #: False while the blocks hold bytes nobody computed here yet (a KV transfer into
    #: them is pending): such blocks must never enter the prefix cache.
    trusted: bool = True
    #: `allocate_external`: per group, leading non-null blocks already held here.
    held: tuple[int, ...] = ()

    def update_hashes(self, block_size: int) -> None:
        parent = self.hashes[-1] if self.hashes else None
        for start in range(
            len(self.hashes) * block_size, len(self.token_ids) - block_size + 1, block_size
        ):
            parent = hash_block(parent, self.token_ids[start : start + block_size])
            self.hashes.append(parent)


class KVCacheManager:
    """Allocates the blocks of every group of one pool for many requests."""

    def __init__(self, config: KVCacheConfig, num_blocks: int, enable_caching: bool = True) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.managers: list[GroupManager] = [
            make_manager(g, self.pool, self.block_size) for g in config.groups
        ]
        self._records: dict[RequestId, _Record] = {}

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._records)

    def has_request(self, rid: RequestId) -> bool:
        return rid in self._records

    def num_computed(self, rid: RequestId) -> int:
        return self._records[rid].num_computed

    def block_ids(self, rid: RequestId) -> BlockIds:
        """Per-group block ids of a request (null block id 0 for skipped positions). The
        lists are live views kept in step by the managers: read them, do not change them."""
        return tuple(m.block_ids(rid) for m in self.managers)

    def find_prefix_hit(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest prefix of `token_ids` cached for *all* groups, in whole blocks. The last
        token is never a hit (its logits must be computed). Changes nothing."""
        empty = PrefixHit(0, tuple([] for _ in self.managers))
        if not self.enable_caching or len(token_ids) < 2:
            return empty
        rec = _Record(list(token_ids))
        rec.update_hashes(self.block_size)
        h = min(len(rec.hashes), (len(token_ids) - 1) // self.block_size)
        # Each group cuts h to its own largest valid hit <= h; repeat to a fixed point so the
        # result is valid for every group at once (any number and mix of groups).
        while True:
            before = h
            for m in self.managers:
                h = m.longest_hit(rec.hashes, h)
            if h == before or h == 0:
                break
        if h == 0:
            return empty
        blocks = tuple(m.hit_blocks(rec.hashes, h) for m in self.managers)
        if any(b is None for b in blocks):  # cannot happen after the fixed point
            raise IntegrityError("prefix hit valid per group but not for all groups")
        return PrefixHit(h * self.block_size, blocks)  # type: ignore[arg-type]

    def num_blocks_needed(
        self, rid: RequestId, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> int:
        rec = self._records.get(rid)
        computed = rec.num_computed if rec else (hit.num_tokens if hit else 0)
        total = computed + num_new_tokens
        need = 0
        for i, m in enumerate(self.managers):
            num_hit = len(hit.blocks[i]) if hit else 0
            # A state group's fresh pages (the copy of a hit snapshot) are counted here.
            need += m.num_new_blocks(rid, total, num_hit)
        if hit and rec is None:
            need += hit.num_blocks_to_take
        return need

    # -- mutations -------------------------------------------------------------------------
    def allocate_slots(
        self,
        rid: RequestId,
        token_ids: Sequence[int],
        num_new_tokens: int,
        hit: PrefixHit | None = None,
    ) -> BlockIds | None:
        """Reserve slots for `num_new_tokens` more tokens of request `rid`.

        `token_ids` is every token of the request known so far (prompt and output). The
        manager keeps a reference to the list of the first call and hashes full blocks as
        they are appended to it (later calls' lists are not read: append to the same list).
        `hit` (first call only) is a fresh result of `find_prefix_hit`. Blocks out of every
        query's reach are released first. Returns the per-group block ids, or None when the
        pool is short (the allocation is then unchanged, though released out-of-window
        blocks stay released).
        """
        rec = self._records.get(rid)
        if rec is not None:
            self.release_out_of_window(rid)
            hit = None
        if self.num_blocks_needed(rid, num_new_tokens, hit) > self.pool.num_free_blocks:
            return None
        if rec is None:
            rec = _Record(token_ids if isinstance(token_ids, list) else list(token_ids))
            self._records[rid] = rec
            if hit is not None and hit.num_tokens:
                rec.num_computed = hit.num_tokens
                for m, blocks in zip(self.managers, hit.blocks, strict=True):
                    m.take_hit(rid, blocks)
                self.release_out_of_window(rid)
        total = rec.num_computed + num_new_tokens
        for m in self.managers:
            m.allocate(rid, total)
        return self.block_ids(rid)

    def allocate_external(
        self,
        rid: RequestId,
        token_ids: Sequence[int],
        num_tokens: int,
        reuse: bool = True,
    ) -> BlockIds | None:
        """Blocks for a new request whose first `num_tokens` tokens were computed elsewhere
        (a KV transfer fills them): only what later steps read. Returns None, changing
        nothing, when the pool is short. The caller commits (`commit_computed`) once the
        bytes are in place, or frees the request if the transfer fails.

        With `reuse` (and prefix caching on), each attention group takes the cached blocks
        it already holds for the leading positions it keeps (`GroupManager.local_hit`);
        `num_held(rid)` says how many leading blocks per group need no transfer. State
        groups always get fresh pages: their state is the one at the end of the prompt."""
        if rid in self._records:
            raise ValueError(f"request {rid} already holds blocks")
        if not 0 < num_tokens <= len(token_ids):
            raise ValueError("num_tokens must be between 1 and the number of known tokens")
        rec = _Record(token_ids if isinstance(token_ids, list) else list(token_ids))
        held: list[list[KVBlock]] = [[] for _ in self.managers]
        if reuse and self.enable_caching:
            rec.update_hashes(self.block_size)
            held = [m.local_hit(rec.hashes, num_tokens) for m in self.managers]
        need = sum(m.num_tail_blocks(num_tokens) for m in self.managers)
        need += sum(1 for h in held for b in h if b.ref_cnt == 0) - sum(map(len, held))
        if need > self.pool.num_free_blocks:
            return None
        rec.num_computed = num_tokens
        rec.trusted = False
        rec.held = tuple(len(h) for h in held)
        self._records[rid] = rec
        for h in held:  # references first: allocating fresh blocks may evict cached ones
            self.pool.touch(h)
        for m, h in zip(self.managers, held, strict=True):
            m.allocate_tail(rid, num_tokens, h)
        return self.block_ids(rid)

    def held_tokens(self, rid: RequestId) -> int:
        """Prompt tokens whose KV an external request found here in every full-attention
        group (0 without one): its prefix-cache hit, as clients see it."""
        held = self.num_held(rid)
        full = [n for m, n in zip(self.managers, held, strict=True) if m.group.spec.kind == "full"]
        return min(full) * self.block_size if full else 0

    def num_held(self, rid: RequestId) -> tuple[int, ...]:
        """Per group, how many of an external request's (`allocate_external`) non-null
        blocks, counted from the first, this pool already held: a transfer skips them."""
        return self._records[rid].held or (0,) * len(self.managers)

    def release_out_of_window(self, rid: RequestId) -> None:
        """Free blocks that no future query of the request reads (sliding window, chunks)."""
        rec = self._records[rid]
        for m in self.managers:
            m.release_skipped(rid, rec.num_computed)

    def commit_computed(self, rid: RequestId, num_computed: int) -> None:
        """The engine computed the request's first `num_computed` tokens: record it and
        register full blocks in the prefix cache."""
        rec = self._records[rid]
        if num_computed < rec.num_computed:
            raise ValueError("num_computed cannot go backwards; free and re-allocate instead")
        rec.num_computed = num_computed
        rec.trusted = True
        if self.enable_caching:
            rec.update_hashes(self.block_size)
            for m in self.managers:
                m.cache_computed(rid, rec.hashes, num_computed)

    def pending_state_copies(self, rid: RequestId) -> list[tuple[BlockId, BlockId]]:
        """(source, destination) page copies the engine must run before the request's next
        step (state snapshots taken over from the prefix cache)."""
        out = []
        for m in self.managers:
            if isinstance(m, StateManager) and (pair := m.take_copies(rid)):
                out += [(s.block_id, d.block_id) for s, d in zip(*pair, strict=True)]
        return out

    def finish_state_copies(self, rid: RequestId) -> None:
        for m in self.managers:
            if isinstance(m, StateManager):
                m.finish_copies(rid)

    def snapshot_states(self, rid: RequestId) -> bool:
        """Keep the request's current states as prefix-cache snapshots (see StateManager)."""
        rec = self._records[rid]
        rec.update_hashes(self.block_size)
        done = [
            m.snapshot(rid, rec.hashes, rec.num_computed)
            for m in self.managers
            if isinstance(m, StateManager)
        ]
        return bool(done) and all(done)

    def reserve_snapshots(self, rid: RequestId, num_tokens: int) -> BlockIds | None:
        """Per group, pages for the request's states after `num_tokens` (a block boundary
        its next step passes inside a chunk; the step writes the states there): [] for the
        groups without states and those whose snapshot is cached already. None, reserving
        nothing, when a state group has no room (or there are no state groups)."""
        if not self.enable_caching or num_tokens % self.block_size:
            return None
        rec = self._records[rid]
        rec.update_hashes(self.block_size)
        h = num_tokens // self.block_size
        states = [m for m in self.managers if isinstance(m, StateManager)]
        out: list[list[int]] = []
        for m in self.managers:
            pages = m.reserve_snapshot(rid, rec.hashes, h) if m in states else []
            if pages is None:  # no room: give back what the groups before took
                for done in states:
                    done.drop_reserved(rid)
                return None
            out.append(pages)
        return tuple(out) if states else None

    def commit_snapshots(self, rid: RequestId) -> None:
        """The step wrote the reserved states: keep them as prefix-cache snapshots."""
        rec = self._records[rid]
        for m in self.managers:
            if isinstance(m, StateManager):
                m.commit_snapshot(rid, rec.hashes)

    def free(self, rid: RequestId, *, keep_cached: bool = True) -> None:
        """Free every block of the request (finish, abort, preemption). Unknown ids are
        ignored, so freeing twice is safe.

        With `keep_cached=False` (a failed step or transfer: pages may hold partial writes)
        nothing new enters the prefix cache. Blocks of a transfer that was never committed
        are always freed that way."""
        rec = self._records.pop(rid, None)
        if rec is None:
            return
        cache = self.enable_caching and keep_cached and rec.trusted
        if cache:
            rec.update_hashes(self.block_size)
        for m in self.managers:
            m.free(rid, rec.hashes if cache else [], rec.num_computed if cache else 0)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus: each block's ref count equals the references requests hold."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for m in self.managers:
            for blocks in m.req_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
            if isinstance(m, StateManager):
                for src, _ in m.pending_copies.values():
                    for b in src:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
                for _, reserved in m.reserved.values():
                    for b in reserved:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for bid in range(1, self.pool.num_blocks):
            block = self.pool.get_block(BlockId(bid))
            if block.ref_cnt != refs.get(bid, 0):
                raise IntegrityError(
                    f"block {bid}: ref count {block.ref_cnt} but requests hold {refs.get(bid, 0)}"
                )
        for m in self.managers:
            for rid, blocks in m.req_blocks.items():
                if m.req_ids.get(rid) != [int(b.block_id) for b in blocks]:
                    raise IntegrityError(f"group {m.group_id}: block ids of {rid} out of step")
            stray = set(m.req_blocks) - set(self._records)
            if stray:
                raise IntegrityError(f"group {m.group_id} holds blocks of unknown {stray}")
