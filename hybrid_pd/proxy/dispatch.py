"""Run one request on the workers, as an async stream of token events.

Long prompts: Prefill on a prefill worker (one retry on another when the first is
UNAVAILABLE or times out, then fall back to running it all on a decode worker), then
Generate with the kv_transfer_params on a decode worker. Short prompts: Generate alone.
Every wait is bounded; `Job.close()` (always called) cancels what is in flight and aborts
the request on the workers it reached, unless it finished there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.proxy.errors import ProxyError
from hybrid_pd.proxy.legs import Leg, Pump, wait_grpc_future
from hybrid_pd.proxy.metrics import ProxyMetrics
from hybrid_pd.proxy.routing import (
    WorkerPool,
    WorkerState,
    prepare_decode_request,
    prepare_prefill_request,
    wants_prefill,
)
from hybrid_pd.proxy.worker_client import PrefillResult, prefill_result

logger = logging.getLogger(__name__)
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class TokenEvent:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""


class Dispatcher:
    def __init__(self, config, pool: WorkerPool, metrics: ProxyMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics

    def start(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float
    ) -> Job:
        return Job(self, request_id, prompt_ids, params, arrival)


class Job:
    def __init__(self, d: Dispatcher, rid: str, prompt_ids, params, arrival: float) -> None:
        self.d = d
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.arrival = arrival
        self.route = ""
        self.legs: list[Leg] = []
        self.done = False
        self.closed = False
        self._last_token_at: float | None = None

    # -- the stream -------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[TokenEvent]:
        d = self.d
        prefill = None
        if wants_prefill(
            len(self.prompt_ids), d.config.min_prefill_tokens, len(d.pool.with_role("prefill"))
        ):
            prefill = await self._prefill()
            self.route = "disaggregated" if prefill is not None else "fallback"
        else:
            self.route = "decode_only"
        d.metrics.routes.labels(self.route).inc()
        emitted = 0
        if prefill is not None:
            self._observe(1)
            if prefill.finished:
                self._finish()
            yield TokenEvent([prefill.first_token], prefill.finished, prefill.finish_reason)
            if prefill.finished:
                return
            emitted = 1
        async for event in self._decode(prefill, emitted):
            yield event

    async def _prefill(self) -> PrefillResult | None:
        d, tried = self.d, []
        for attempt in range(2):
            worker = await asyncio.to_thread(d.pool.pick_prefill, tried)
            if worker is None:
                break
            tried.append(worker)
            call = prepare_prefill_request(self.rid, self.prompt_ids, self.params, attempt)
            future = worker.client.prefill_future(
                call.request_id, call.prompt_ids, call.sampling, d.config.prefill_timeout_s
            )
            leg = Leg(
                d.pool,
                worker,
                call.request_id,
                "prefill",
                future,
                len(call.prompt_ids),
                d.config.control_timeout_s,
            )
            self.legs.append(leg)
            try:
                reply = await wait_grpc_future(future)
            except grpc.RpcError as e:
                leg.abort()  # it may still run there (deadline): drop it
                code = e.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ProxyError(400, e.details() or "invalid request") from e
                d.pool.mark_failed(worker, f"{code.name}: {e.details()}")
                logger.warning("prefill on %s failed: %s %s", worker.address, code, e.details())
                if code not in _RETRYABLE:
                    d.metrics.failure("prefill_error")
                    break
                d.metrics.failure("prefill_unavailable")
                continue
            leg.release()
            d.pool.mark_ok(worker)
            return prefill_result(reply)
        d.metrics.failure("prefill_fallback")
        return None

    async def _decode(self, prefill: PrefillResult | None, emitted: int):
        d, exclude = self.d, []
        for attempt in range(2):
            worker = await asyncio.to_thread(d.pool.pick_decode, exclude)
            if worker is None:
                raise ProxyError(503, self._no_worker(), kind="no_worker")
            call = prepare_decode_request(
                self.rid, self.prompt_ids, self.params, prefill, d.config.failure_policy, attempt
            )
            stream = worker.client.generate_stream(
                call.request_id,
                call.prompt_ids,
                call.sampling,
                call.kv_transfer_params,
                call.failure_policy,
                timeout_s=d.config.request_timeout_s,
            )
            leg = Leg(
                d.pool,
                worker,
                call.request_id,
                "decode",
                stream,
                abort_timeout_s=d.config.control_timeout_s,
            )
            self.legs.append(leg)
            pump = Pump(stream, asyncio.get_running_loop())
            seen: list[int] = []
            while True:
                kind, item = await pump.get(d.config.stream_idle_timeout_s, worker.address)
                if kind == "error":
                    code = item.code() if isinstance(item, grpc.RpcError) else None
                    if code == grpc.StatusCode.UNAVAILABLE and not seen and prefill is None:
                        # Never reached the worker: safe to run it on another one, once.
                        leg.abort()
                        d.pool.mark_failed(worker, f"UNAVAILABLE: {item.details()}")
                        d.metrics.failure("decode_unavailable")
                        exclude.append(worker)
                        break
                    raise self._decode_error(worker, item)
                if kind == "end":
                    raise ProxyError(
                        500, "the decode stream ended before the request did", kind="decode_error"
                    )
                chunk = item
                if not seen and chunk.HasField("transfer") and prefill is not None:
                    t = chunk.transfer
                    d.metrics.transfer(t.bytes, t.seconds, t.recomputed)
                if chunk.error:
                    msg = f"decode failed on {worker.address}: {chunk.error}"
                    raise ProxyError(500, msg, kind="decode_error")
                seen += chunk.token_ids
                new = seen[emitted:]
                emitted = max(emitted, len(seen))
                if new:
                    self._observe(len(new))
                if chunk.finished:
                    leg.release()
                    d.pool.mark_ok(worker)
                    self._finish()
                    yield TokenEvent(new, True, chunk.finish_reason)
                    return
                if new:
                    yield TokenEvent(new)
        raise ProxyError(503, self._no_worker(), kind="no_worker")

    def _no_worker(self) -> str:
        errors = [
            f"{w['address']}: {w['last_error']}"
            for w in self.d.pool.snapshot()
            if "decode" in w["roles"] and w["last_error"]
        ]
        return "no decode worker is available" + (f" ({'; '.join(errors)})" if errors else "")

    def _decode_error(self, worker: WorkerState, e: BaseException) -> ProxyError:
        if isinstance(e, ProxyError):
            return e
        if not isinstance(e, grpc.RpcError):
            return ProxyError(500, f"decode failed on {worker.address}: {e}", kind="decode_error")
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ProxyError(400, details or "invalid request")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ProxyError(504, f"decode on {worker.address} timed out", kind="timeout")
        if code == grpc.StatusCode.UNAVAILABLE:
            self.d.pool.mark_failed(worker, f"UNAVAILABLE: {details}")
            return ProxyError(
                503,
                f"decode worker {worker.address} unavailable: {details}",
                kind="decode_unavailable",
            )
        return ProxyError(
            500, f"decode failed on {worker.address}: {code.name}: {details}", kind="decode_error"
        )

    # -- bookkeeping ------------------------------------------------------------------------
    def _observe(self, n: int) -> None:
        now = time.monotonic()
        m = self.d.metrics
        if self._last_token_at is None:
            m.ttft.observe(now - self.arrival)
            n -= 1
        elif n > 0:
            gap = (now - self._last_token_at) / n
            for _ in range(n):
                m.itl.observe(gap)
        self._last_token_at = now

    def _finish(self) -> None:
        self.done = True
        self.d.metrics.e2e.observe(time.monotonic() - self.arrival)

    def close(self) -> None:
        """Idempotent and synchronous (safe in `finally` of a cancelled task)."""
        if self.closed:
            return
        self.closed = True
        for leg in self.legs:
            if self.done:
                leg.release()
            else:
                leg.abort()
