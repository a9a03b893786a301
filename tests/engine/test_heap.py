"""freeze_startup_heap: garbage is collected first, what is alive is frozen."""

from __future__ import annotations

import gc
import weakref

from hybrid_pd.engine.heap import freeze_startup_heap, frozen_heap


class _Node:
    pass


def test_collects_garbage_then_freezes_what_is_alive(monkeypatch):
    monkeypatch.delenv("HYBRID_PD_GC_FREEZE", raising=False)
    alive = _Node()
    cycle = _Node()
    cycle.me = cycle  # garbage only a collection frees
    dead = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert dead() is None  # collected before the freeze, not kept forever
        assert gc.is_tracked(alive)
        gc.collect()  # a full collection no longer walks the frozen objects
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("HYBRID_PD_GC_FREEZE", "0")
    assert freeze_startup_heap() == 0
    assert gc.get_freeze_count() == 0


def test_frozen_heap_thaws_at_the_end(monkeypatch):
    monkeypatch.delenv("HYBRID_PD_GC_FREEZE", raising=False)
    with frozen_heap() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
