"""Shared helpers for the KV cache manager tests: tiny configs and invariant checks."""

from __future__ import annotations

from hybrid_pd.kvcache.config import KVCacheConfig, KVCacheGroup, align_up, slot_bytes_for
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.managers import StateManager
from hybrid_pd.kvcache.specs import LayerSpec, StateSpec


def tiny_config(*specs: LayerSpec, block_size: int = 4, span: int = 1) -> KVCacheConfig:
    """One single-layer group per spec (layer `L<i>`); state groups spread over `span`."""
    slots = [slot_bytes_for(s, block_size, span if isinstance(s, StateSpec) else 1) for s in specs]
    groups = tuple(
        KVCacheGroup(i, s, (f"L{i}",), slot, span if isinstance(s, StateSpec) else 1)
        for i, (s, slot) in enumerate(zip(specs, slots, strict=True))
    )
    return KVCacheConfig(block_size, align_up(max(slots)), groups)


def check(mgr: KVCacheManager) -> None:
    """`check_integrity` plus: a block lives in one group only; a block held more than once
    was shared through the prefix cache (it carries that group's key); a request's current
    state pages are private; nothing leaks once no request is live."""
    mgr.check_integrity()
    group_of: dict[int, int] = {}
    for g, m in enumerate(mgr.managers):
        lists = list(m.req_blocks.values())
        if isinstance(m, StateManager):
            lists += [src for src, _ in m.pending_copies.values()]
            for pages in m.req_blocks.values():
                assert len(pages) == m.span
                for b in pages:
                    assert b.ref_cnt == 1 and b.cache_key is None, f"state page {b} shared"
        for blocks in lists:
            real = [b.block_id for b in blocks if not b.is_null]
            assert len(real) == len(set(real)), f"group {g}: block listed twice in {real}"
            for b in blocks:
                if b.is_null:
                    continue
                first = group_of.setdefault(b.block_id, g)
                assert first == g, f"block {b.block_id} held by groups {first} and {g}"
                if b.ref_cnt > 1:
                    assert b.cache_key is not None and b.cache_key[1] == g, repr(b)
    if mgr.num_requests == 0:
        assert mgr.pool.num_free_blocks == mgr.pool.num_blocks - 1


class CheckedManager(KVCacheManager):
    """A KVCacheManager that runs `check` after every (outermost) mutating call."""

    _depth = 0

    def _checked(self, method, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._depth += 1
        try:
            return method(*args, **kwargs)
        finally:
            self._depth -= 1
            if not self._depth:
                check(self)

    def allocate_slots(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return self._checked(super().allocate_slots, *args, **kwargs)

    def commit_computed(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return self._checked(super().commit_computed, *args, **kwargs)

    def release_out_of_window(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return self._checked(super().release_out_of_window, *args, **kwargs)

    def snapshot_states(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return self._checked(super().snapshot_states, *args, **kwargs)

    def finish_state_copies(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return self._checked(super().finish_state_copies, *args, **kwargs)

    def free(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return self._checked(super().free, *args, **kwargs)
