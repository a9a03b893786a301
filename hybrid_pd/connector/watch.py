"""Per-request change events: how a waiter learns that a request's state moved.

The prefill connector fires a request's watchers whenever its state changes (a step
published progress, it was preempted, kept, released, expired or ended). A waiter registers
before it looks at the state, so no change can fall between its look and its wait:

    Watchers.fire(request id)  ──►  callbacks of that id (any thread, never blocking)
    until(...)       an RPC handler on the event loop awaits; no thread is held
    wait_until(...)  a plain thread blocks (direct callers of the connector only)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Watchers:
    """Callbacks per key. `fire(key)` calls the key's callbacks on the firing thread, so a
    callback must only hand the news on (set an event, schedule on a loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, set[Callable[[], None]]] = {}

    def add(self, key: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Watch `key`; returns the function that stops watching it."""
        with self._lock:
            self._by_key.setdefault(key, set()).add(callback)

        def remove() -> None:
            with self._lock:
                found = self._by_key.get(key)
                if found is not None:
                    found.discard(callback)
                    if not found:
                        del self._by_key[key]

        return remove

    def fire(self, key: str) -> None:
        with self._lock:
            callbacks = list(self._by_key.get(key, ()))
        for callback in callbacks:
            callback()

    def fire_all(self) -> None:
        """Every watcher looks again (shutdown)."""
        with self._lock:
            callbacks = [c for found in self._by_key.values() for c in found]
        for callback in callbacks:
            callback()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(found) for found in self._by_key.values())


async def until(
    watchers: Watchers, key: str, check: Callable[[], tuple[bool, T]], timeout: float
) -> T:
    """On an event loop: await `check()` -> (done, value) until done or `timeout` seconds
    passed, looking again only when `key` fires; returns the last value. `check` runs on the
    loop (it must not block) and may raise, which ends the wait."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def wake() -> None:  # from any thread; a closed loop has no waiter left to wake
        try:
            loop.call_soon_threadsafe(changed.set)
        except RuntimeError:
            pass

    remove = watchers.add(key, wake)
    deadline = loop.time() + max(timeout, 0.0)
    try:
        while True:
            changed.clear()
            done, value = check()
            left = deadline - loop.time()
            if done or left <= 0:
                return value
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                pass
    finally:
        remove()


def wait_until(watchers: Watchers, key: str, check: Callable[[], bool], timeout: float) -> bool:
    """On a plain thread: block until `check()` or `timeout` seconds passed, looking again
    only when `key` fires; returns the last `check()`."""
    changed = threading.Event()
    remove = watchers.add(key, changed.set)
    deadline = time.monotonic() + max(timeout, 0.0)
    try:
        while True:
            changed.clear()
            if check():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            changed.wait(left)
    finally:
        remove()
