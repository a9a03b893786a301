"""EngineLoop: drive an Engine from its own thread.

Other threads never touch the engine. They `post` operations, which run on the engine thread
between steps in the order posted (each returns a Future), and they receive a request's
outputs through the sink they gave at `submit`. Nothing here blocks a caller for a step:

    RPC handler ──post(add_request)──► inbox ──► engine thread: ops, step, ops, step ...
                ◄──sink(output)───────────────────────────┘
    Stats ──► `snapshot` (published by the engine thread after every step)

A step that raises fails the requests it held (their blocks are freed, nothing they hold is
cached) and the loop goes on. When nothing can progress (the pool is full and no request
runs) the loop sleeps until something is posted or `wake` is called (a KV load ended).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from hybrid_pd.engine.engine import Engine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
Sink = Callable[[Any], None]

#: A busy engine checks its pool's invariants this often (an idle one on every tick).
INTEGRITY_EVERY_S = 5.0


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
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Callable[[], Any], Future]] = deque()
        self._sinks: dict[str, Sink] = {}
        self._stop = False
        self._stalled = False
        self._hooks = list(idle_hooks or [])
        self._tick = tick_s
        self._integrity = "ok"
        self._checked_at = 0.0
        #: Read by any thread without a lock (replaced whole, never mutated).
        self.snapshot: dict[str, Any] = {}
        self._publish(check=True)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- posting ----------------------------------------------------------------------------
    def post(self, fn: Callable[..., T], *args, **kwargs) -> Future:
        """Run `fn(*args, **kwargs)` on the engine thread between steps; a Future of its
        result (or exception)."""
        fut: Future = Future()
        with self._cond:
            if self._stop:
                fut.set_exception(RuntimeError("the engine loop is stopped"))
                return fut
            self._inbox.append((lambda: fn(*args, **kwargs), fut))
            self._stalled = False
            self._cond.notify()
        return fut

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run `fn` between steps and wait for its result (inline on the engine thread)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.post(fn, *args, **kwargs).result()

    def wake(self) -> None:
        """Something the engine waits for happened (a KV load ended): step again."""
        with self._cond:
            self._stalled = False
            self._cond.notify()

    def add_hook(self, hook: Callable[[], Any]) -> None:
        self._hooks.append(hook)

    def submit(self, *args, sink: Sink, **kwargs) -> Future:
        """`Engine.add_request(*args, **kwargs)` on the engine thread; a Future of the
        request id (ValueError for requests that can never run: nothing is queued then).
        Every output of the request, or a RequestFailed, is passed to `sink` on the engine
        thread; `sink` must not block."""

        def add() -> str:
            rid = self.engine.add_request(*args, **kwargs)
            self._sinks[rid] = sink
            return rid

        return self.post(add)

    def abort(self, request_id: str) -> Future:
        """Drop a request wherever it is; a Future of the engine's Request (None if unknown
        or already finished). Its sink gets RequestFailed("aborted")."""

        def drop():
            req = self.engine.abort(request_id)
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(RequestFailed("aborted"))
            return req

        return self.post(drop)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------
    def _ready(self) -> bool:
        e = self.engine
        if not e.has_unfinished():
            return False
        # An ended load is news even if the last step found nothing to do.
        return e.loads_ended() or (not self._stalled and e.can_step())

    def _run(self) -> None:
        next_tick = time.monotonic() + self._tick
        while True:
            with self._cond:
                if not self._inbox and not self._stop and not self._ready():
                    self._cond.wait(max(0.0, next_tick - time.monotonic()))
                if self._stop:
                    break
                ops = list(self._inbox)
                self._inbox.clear()
            for fn, fut in ops:
                # A caller that gave up (a client gone) cancelled its Future before we
                # got here: skip its work (and a cancelled Future takes no result).
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn()
                except BaseException as e:  # reported to whoever posted it
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            if ops:  # a step that ended while they were posted may have marked us stalled
                self._stalled = False
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick
                self._run_hooks()
                self._stalled = False  # hooks free blocks; at worst one idle step a tick
            if self._ready():
                self._step()
            elif ops or not self.engine.has_unfinished():
                self._publish()
        self._fail_remaining()

    def _step(self) -> None:
        steps = self.engine.num_steps_with_work
        try:
            outputs = self.engine.step()
            failed: list[str] = []
        except Exception as e:  # keep serving: fail what the step held
            logger.exception("engine step failed")
            outputs, failed, error = [], self.engine.fail_all(), e
        # Nothing scheduled, started or ended: wait for news instead of spinning.
        self._stalled = self.engine.num_steps_with_work == steps and not outputs and not failed
        for out in outputs:
            self._deliver(out)
        for rid in failed:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink(RequestFailed(f"engine error: {error}"))
        self._publish()

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
        if sink is not None:
            sink(out)

    def _fail_remaining(self) -> None:
        with self._cond:  # posted after the last round: their callers must not wait on
            ops = list(self._inbox)
            self._inbox.clear()
        for _, fut in ops:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine loop is stopped"))
        for sink in self._sinks.values():
            sink(RequestFailed("the worker is shutting down"))
        self._sinks.clear()

    def _publish(self, check: bool = False) -> None:
        e = self.engine
        kv = e.kv
        now = time.monotonic()
        if check or not e.has_unfinished() or now - self._checked_at > INTEGRITY_EVERY_S:
            self._checked_at = now
            try:
                kv.check_integrity()
                self._integrity = "ok"
            except Exception as err:  # reported by Stats, never raised at callers
                self._integrity = f"{type(err).__name__}: {err}"
        self.snapshot = {
            "num_blocks": kv.pool.num_blocks,
            "free_blocks": kv.pool.num_free_blocks,
            "cached_blocks": kv.pool.num_cached_blocks,
            "kv_requests": kv.num_requests,
            "running": len(e.scheduler.running),
            "waiting": len(e.scheduler.waiting),
            "receiving": len(e.scheduler.receiving),
            "integrity": self._integrity,
            "published_at": time.time(),
        }

    def _run_hooks(self) -> None:
        for hook in self._hooks:
            try:
                hook()
            except Exception:
                logger.exception("idle hook failed")
