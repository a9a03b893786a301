"""EngineLoop: drive an Engine from a background thread; other threads submit and wait.

Every engine call happens under one lock, so connectors and RPC handlers may free blocks or
reserve them between steps. Outputs reach each request's queue; a step that raises fails
the requests it held (their blocks are freed) and the loop goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from hybrid_pd.engine.engine import Engine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RequestFailed(RuntimeError):
    pass


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        idle_hooks: list[Callable[[], Any]] | None = None,
        tick_s: float = 0.25,
    ) -> None:
        self.engine = engine
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._queues: dict[str, queue.Queue] = {}
        self._stop = False
        self._hooks = list(idle_hooks or [])
        self._tick = tick_s
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run `fn` under the engine lock (between steps)."""
        with self._lock:
            return fn(*args, **kwargs)

    def add_hook(self, hook: Callable[[], Any]) -> None:
        self._hooks.append(hook)

    def submit(self, *args, **kwargs) -> tuple[str, queue.Queue]:
        """`Engine.add_request(*args, **kwargs)`; returns (request id, output queue). Raises
        ValueError for requests that can never run (nothing is queued then)."""
        with self._lock:
            rid = self.engine.add_request(*args, **kwargs)
            q: queue.Queue = queue.Queue()
            self._queues[rid] = q
            self._wake.notify()
        return rid, q

    def adopt(self, request_id: str, fn: Callable[[], None]) -> queue.Queue:
        """Run `fn` (which admits `request_id` to the engine) under the lock and return the
        queue its outputs will reach."""
        with self._lock:
            q: queue.Queue = queue.Queue()
            self._queues[request_id] = q
            try:
                fn()
            except BaseException:
                self._queues.pop(request_id, None)
                raise
            self._wake.notify()
        return q

    def abort(self, request_id: str) -> bool:
        with self._lock:
            found = self.engine.abort(request_id)
            q = self._queues.pop(request_id, None)
        if q is not None:
            q.put(RequestFailed("aborted"))
        return found

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.engine.has_unfinished():
                    self._wake.wait(self._tick)
                    self._run_hooks()
                if self._stop:
                    return
                try:
                    outputs = self.engine.step()
                    failed: list[tuple[str, Exception]] = []
                except Exception as e:  # keep serving: fail what the step held
                    logger.exception("engine step failed")
                    outputs = []
                    failed = [(rid, e) for rid in list(self.engine.requests)]
                    for rid, _ in failed:
                        self.engine.abort(rid)
                self._run_hooks()
                deliveries = []
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        deliveries.append((q, out))
                        if out.finished:
                            self._queues.pop(out.request_id, None)
                for rid, e in failed:
                    q = self._queues.pop(rid, None)
                    if q is not None:
                        deliveries.append((q, RequestFailed(f"engine error: {e}")))
            for q, item in deliveries:
                q.put(item)

    def _run_hooks(self) -> None:
        for hook in self._hooks:
            try:
                hook()
            except Exception:
                logger.exception("idle hook failed")


def next_output(q: queue.Queue, timeout: float) -> RequestOutput:
    """The next output of a request; raises RequestFailed on error, abort or timeout."""
    try:
        item = q.get(timeout=timeout)
    except queue.Empty:
        raise RequestFailed(f"no output within {timeout:.0f} s") from None
    if isinstance(item, Exception):
        raise item
    return item
