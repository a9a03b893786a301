"""Run one request on the workers, as an async stream of token events.

Long prompts: Prefill on a prefill worker, then Generate with the kv_transfer_params on a
decode worker. Short prompts: Generate alone. What keeps a request alive:

- backpressure: a worker with a full queue answers RESOURCE_EXHAUSTED; the request is held
  (bounded by `queue_timeout_s`) and offered to workers with room, then 429 + Retry-After.
  The proxy itself holds at most `max_pending_requests` (429 at once past that);
- a dead prefill worker: the prefill is retried on another one; with no prefill worker up,
  up to `max_fallback_prefills` run wholly on decode workers, the rest wait;
- a dead decode worker: the stream migrates: the proxy resubmits prompt + every token already
  produced to another decode worker (or the restarted one) and the client's stream goes on
  where it was (greedy output unchanged), at most `max_migrations` times.

Overlap (`overlap_transfer`): the first Prefill carries a transfer token and the decode leg
starts at once with staged kv_transfer_params, pulling computed blocks while the prompt
computes. Should the prefill fail, the staged leg is dropped and the ordinary path runs;
should the staged leg fail before its first token, an ordinary decode leg takes over with
the prefill's params.

Every wait is bounded; `Job.close()` (always called) cancels what is in flight and aborts
the request on the workers it reached, unless it finished there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from hybrid_pd.api.sampling import SamplingParams, TokenLogprob
from hybrid_pd.api.wire import logprob_from_pb
from hybrid_pd.proxy import access_log
from hybrid_pd.proxy.calls import (
    DecodeCall,
    prepare_decode_request,
    wants_prefill,
)
from hybrid_pd.proxy.errors import ProxyError, overloaded
from hybrid_pd.proxy.legs import BACKOFF_CAP_S, BACKOFF_S, FULL, Leg, Pump
from hybrid_pd.proxy.metrics import ProxyMetrics
from hybrid_pd.proxy.prefill_phase import PrefillPhase
from hybrid_pd.proxy.routing import WorkerPool, WorkerState
from hybrid_pd.proxy.worker_client import PrefillResult

logger = logging.getLogger(__name__)
#: A decode leg that failed this way lost its worker (or its engine): migrate the stream.
_LOST = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
)


@dataclass
class TokenEvent:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    #: One per token when the sampling asked for logprobs, else None.
    logprobs: list[TokenLogprob | None] | None = None


class _Migrate(Exception):
    """The decode leg lost its worker (status 503) or its engine failed the request (500):
    resume elsewhere; `status` is what the client sees when migrations run out."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class Dispatcher:
    def __init__(self, config, pool: WorkerPool, metrics: ProxyMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.pending = 0  # requests held or running (event loop only)
        self.fallbacks = 0  # prefills running on decode workers now

    def start(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float
    ) -> Job:
        return Job(self, request_id, prompt_ids, params, arrival)


class Job(PrefillPhase):
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
        self.counted = False
        self.fallback = False
        self.migrations = 0
        #: Every output token produced so far (what a migrated stream resumes from).
        self.produced: list[int] = []
        #: The prompt's logprobs once a worker computed them (when the sampling asks).
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None
        #: Addresses of the workers that served it (the last one of each kind), for the log.
        self.prefill_worker = ""
        self.decode_worker = ""
        #: Overlap: the decode leg started beside the prefill (worker, call, leg, pump).
        self.staged: tuple[WorkerState, DecodeCall, Leg, Pump] | None = None
        access_log.attach(self)

    # -- the stream -------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[TokenEvent]:
        d = self.d
        if d.pending >= d.config.max_pending_requests:
            raise overloaded(
                f"the proxy holds {d.pending} requests already "
                f"(max_pending_requests={d.config.max_pending_requests}); retry later"
            )
        d.pending += 1
        self.counted = True
        prefill = None
        if wants_prefill(
            len(self.prompt_ids), d.config.min_prefill_tokens, len(d.pool.with_role("prefill"))
        ):
            prefill = await self._prefill()
            self.route = "disaggregated" if prefill is not None else "fallback"
        else:
            self.route = "decode_only"
        if prefill is None or prefill.finished:
            self._drop_staged()  # nothing to hand over
        d.metrics.routes.labels(self.route).inc()
        if prefill is not None:
            self._observe(1)
            if prefill.finished:
                self._finish()
            self.produced.append(prefill.first_token)
            self.prompt_logprobs = prefill.prompt_logprobs
            logprobs = None if self.params.logprobs is None else [prefill.first_logprob]
            yield TokenEvent(
                [prefill.first_token], prefill.finished, prefill.finish_reason, logprobs
            )
            if prefill.finished:
                return
        async for event in self._decode(prefill):
            yield event

    # -- decode -----------------------------------------------------------------------------
    async def _decode(self, prefill: PrefillResult | None):
        d = self.d
        attempt = 0
        deadline = time.monotonic() + d.config.queue_timeout_s
        staged, self.staged = self.staged, None
        while True:
            self._check_open()
            opened = None
            if staged is not None:  # started beside the prefill (overlap)
                worker, call, *opened = staged
                staged = None
            else:
                worker = await self._pick_decode(deadline)
                params = self.params
                if self.prompt_logprobs is not None:  # scored already: not computed again
                    params = dataclasses.replace(params, prompt_logprobs=None)
                call = prepare_decode_request(
                    self.rid,
                    self.prompt_ids,
                    params,
                    prefill,
                    d.config.failure_policy,
                    attempt,
                    output_ids=() if prefill is not None else self.produced,
                )
                attempt += 1
            await asyncio.to_thread(d.pool.note_tokens, worker, self.prompt_ids)
            self.decode_worker = worker.address
            try:
                async for event in self._decode_leg(worker, call, prefill is not None, opened):
                    yield event
                # What it computed stays in its prefix cache: the next turn's prefix.
                await asyncio.to_thread(d.pool.note_tokens, worker, self.prompt_ids + self.produced)
                return
            except ProxyError as e:
                if not self._staged_fell_back(opened, e):
                    raise
            except _Migrate as e:
                if self._staged_fell_back(opened, e):
                    continue
                self.migrations += 1
                if self.migrations > d.config.max_migrations:
                    raise ProxyError(
                        e.status,
                        f"decode failed {self.migrations} times; last on {worker.address}: {e}",
                        kind="decode_lost" if e.status == 503 else "decode_error",
                    ) from None
                d.metrics.failure("migrated")
                if prefill is not None:  # the KV may never be pulled now: free it at once
                    self._drop_kept_kv()
                logger.warning(
                    "request %s: decode on %s lost (%s); migrating after %d tokens",
                    self.rid,
                    worker.address,
                    e,
                    len(self.produced),
                )
                prefill = None  # resume from prompt + produced tokens, recomputed
                deadline = time.monotonic() + d.config.queue_timeout_s
            except _Full:
                if self._staged_fell_back(opened, "its queue was full"):
                    continue
                # The deadline holds on this path too: a worker whose full-backoff has
                # ended is picked again at once, so _pick_decode alone would never see it.
                if time.monotonic() > deadline:
                    raise overloaded("every decode worker is busy; retry later") from None
                continue

    def _staged_fell_back(self, opened, why) -> bool:
        """Whether a failed leg was the staged one, before any token of its own: then an
        ordinary leg takes the prefill's params (its kept KV, or a recompute from the
        first token), and the failure counts as no migration."""
        if opened is None or len(self.produced) > 1:
            return False
        self.d.metrics.failure("staged_fallback")
        logger.warning("request %s: the staged decode leg failed (%s)", self.rid, why)
        return True

    async def _pick_decode(self, deadline: float) -> WorkerState:
        """A live decode worker with room, waiting until `deadline` while all are full or
        down (a restarting worker comes back under a new address)."""
        d = self.d
        backoff = BACKOFF_S
        while True:
            worker = await asyncio.to_thread(d.pool.pick_decode, (), self.prompt_ids)
            if worker is not None:
                return worker
            if time.monotonic() > deadline:
                if d.pool.live("decode"):
                    raise overloaded("every decode worker is busy; retry later")
                raise ProxyError(503, self._no_worker(), kind="no_worker")
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, BACKOFF_CAP_S)

    async def _open_decode_leg(self, worker: WorkerState, call, with_kv: bool):
        """Start a Generate stream on `worker`: (its Leg, the Pump that reads it)."""
        d = self.d
        if with_kv:
            source = call.kv_transfer_params.control_address
            if source and not d.pool.knows_peer(worker, source):
                await asyncio.to_thread(d.pool.ensure_peer, worker, source)
        stream = worker.client.generate_stream(
            call.request_id,
            call.prompt_ids,
            call.sampling,
            call.kv_transfer_params,
            call.failure_policy,
            timeout_s=d.config.request_timeout_s,
            output_ids=call.output_ids,
        )
        leg = self._add_leg(
            Leg(
                d.pool,
                worker,
                call.request_id,
                "decode",
                stream,
                abort_timeout_s=d.config.control_timeout_s,
            )
        )
        return leg, Pump(stream, asyncio.get_running_loop())

    async def _decode_leg(self, worker: WorkerState, call, with_kv: bool, opened=None):
        d = self.d
        leg, pump = opened or await self._open_decode_leg(worker, call, with_kv)
        # The worker sends every output token from the first, the ones it resumed from
        # (the prefill's first token, or a migrated stream's) included.
        seen: list[int] = []
        seen_logprobs: list[TokenLogprob | None] = []
        while True:
            kind, item = await pump.get(d.config.stream_idle_timeout_s, worker.address)
            self._check_open()
            if kind == "error":
                raise self._leg_error(leg, worker, item, started=bool(seen))
            if kind == "end":
                leg.abort()
                raise _Migrate("the stream ended before the request did")
            chunk = item
            if not seen and chunk.HasField("transfer") and with_kv:
                t = chunk.transfer
                d.metrics.transfer(t.bytes, t.seconds, t.recomputed)
                if t.recomputed:  # the KV was not pulled: let the prefill worker free it
                    self._drop_kept_kv()
            if chunk.error:
                leg.abort()
                raise _Migrate(f"worker error: {chunk.error}", status=500)
            if chunk.prompt_logprobs and self.prompt_logprobs is None:
                self.prompt_logprobs = [logprob_from_pb(lp) for lp in chunk.prompt_logprobs]
            seen += chunk.token_ids
            seen_logprobs += [logprob_from_pb(lp) for lp in chunk.logprobs]
            seen_logprobs += [None] * (len(seen) - len(seen_logprobs))  # a worker sent none
            # Output positions: seen[i] is the request's i-th output token.
            new = seen[len(self.produced) :]
            logprobs = None
            if self.params.logprobs is not None:
                logprobs = seen_logprobs[len(self.produced) : len(seen)]
            self.produced += new
            if new:
                self._observe(len(new))
            if chunk.finished:
                leg.release()
                d.pool.mark_ok(worker)
                self._finish()
                yield TokenEvent(new, True, chunk.finish_reason, logprobs)
                return
            if new:
                yield TokenEvent(new, logprobs=logprobs)

    def _leg_error(self, leg: Leg, worker: WorkerState, e, started: bool) -> Exception:
        if isinstance(e, ProxyError):  # the idle timeout
            leg.abort()
            return e
        if not isinstance(e, grpc.RpcError):
            leg.abort()
            return _Migrate(f"{type(e).__name__}: {e}")
        code, details = e.code(), e.details()
        if code == FULL and not started:
            leg.release()
            self.d.pool.mark_full(worker)
            return _Full()
        leg.abort()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ProxyError(400, details or "invalid request")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ProxyError(504, f"decode on {worker.address} timed out", kind="timeout")
        if code == grpc.StatusCode.ABORTED:  # the KV pull failed under policy "fail"
            return ProxyError(503, f"decode on {worker.address}: {details}", kind="kv_transfer")
        if code in _LOST:
            if code == grpc.StatusCode.UNAVAILABLE:
                self.d.pool.mark_failed(worker, f"UNAVAILABLE: {details}")
                self.d.metrics.failure("decode_unavailable")
            return _Migrate(f"{code.name}: {details}")
        return ProxyError(
            500, f"decode failed on {worker.address}: {code.name}: {details}", kind="decode_error"
        )

    def _add_leg(self, leg: Leg) -> Leg:
        """Track `leg` so close() ends it; a job closed already ends it at once."""
        self.legs.append(leg)
        self._check_open()
        return leg

    def _check_open(self) -> None:
        """Raise CancelledError once the job is closed: whoever read its events has gone,
        and what is in flight was aborted. Nothing may retry or migrate after that (a
        cancelled gRPC call looks like a lost worker; Python 3.11's wait_for can swallow the
        task's own cancellation when the queue had an item at the same moment)."""
        if self.closed:
            for leg in self.legs:
                leg.abort()
            raise asyncio.CancelledError(f"request {self.rid} was closed")

    def _drop_kept_kv(self) -> None:
        """Abort (with its transfer token) the KV a prefill worker keeps for this request."""
        for leg in self.legs:
            if leg.kind == "prefill" and leg.transfer_token:
                leg.abort()

    def _no_worker(self) -> str:
        errors = [
            f"{w['address']}: {w['last_error']}"
            for w in self.d.pool.snapshot()
            if "decode" in w["roles"] and w["last_error"]
        ]
        return "no decode worker is available" + (f" ({'; '.join(errors)})" if errors else "")

    # -- bookkeeping ------------------------------------------------------------------------
    def _observe(self, n: int) -> None:
        now = time.monotonic()
        m = self.d.metrics
        if self._last_token_at is None:
            self.first_token_at = now
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
        if self.counted:
            self.d.pending -= 1
        if self.fallback:
            self.d.fallbacks -= 1
        for leg in self.legs:
            if self.done:
                leg.release()
            else:
                leg.abort()


class _Full(Exception):
    """The decode worker's queue was full before the request started: pick again."""
