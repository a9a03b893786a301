"""The prefill phase of a request (`Job`'s half that runs before the decode leg): the
Prefill leg with its retries and fallback to decode workers, and, with `overlap_transfer`,
the staged decode leg started beside it. Its methods read and set `Job`'s state
(`d`, `rid`, `prompt_ids`, `params`, `staged`, `fallback`, `closed`, `prefill_worker`) and
call its decode-side helpers (`_open_decode_leg`, `_add_leg`, `_check_open`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import grpc

from hybrid_pd.api.ids import RequestId
from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.proxy.calls import prepare_decode_request, prepare_prefill_request
from hybrid_pd.proxy.errors import ProxyError, overloaded
from hybrid_pd.proxy.legs import BACKOFF_CAP_S, BACKOFF_S, FULL, Leg, wait_grpc_future
from hybrid_pd.proxy.routing import WorkerState
from hybrid_pd.proxy.worker_client import PrefillResult, prefill_result

logger = logging.getLogger("hybrid_pd.proxy.dispatch")  # its records read as before the split


class PrefillPhase:
    """Mixin of `Job` (proxy/dispatch.py): the prefill leg and the staged decode leg."""

    async def _prefill(self) -> PrefillResult | None:
        """The prefill's result, or None: run it all on a decode worker (fallback)."""
        d = self.d
        deadline = time.monotonic() + d.config.queue_timeout_s
        tried: list[WorkerState] = []
        backoff = BACKOFF_S
        attempt = 0
        while True:
            self._check_open()
            worker = await asyncio.to_thread(d.pool.pick_prefill, tried, self.prompt_ids)
            if worker is None:
                if not d.pool.live("prefill") and self._take_fallback():
                    d.metrics.failure("prefill_fallback")
                    return None
                if time.monotonic() > deadline:
                    raise overloaded("every prefill worker is busy or down; retry later")
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, BACKOFF_CAP_S)
                tried = []
                continue
            call = prepare_prefill_request(self.rid, self.prompt_ids, self.params, attempt)
            attempt += 1
            await asyncio.to_thread(d.pool.note_tokens, worker, self.prompt_ids)
            self.prefill_worker = worker.address
            token = secrets.token_urlsafe(32) if self._may_stage(attempt) else ""
            future = worker.client.prefill_future(
                call.request_id,
                call.prompt_ids,
                call.sampling,
                d.config.prefill_timeout_s,
                transfer_token=token,
            )
            leg = self._add_leg(
                Leg(
                    d.pool,
                    worker,
                    call.request_id,
                    "prefill",
                    future,
                    len(call.prompt_ids),
                    d.config.control_timeout_s,
                )
            )
            if token:
                await self._start_staged(worker, call.request_id, token)
            try:
                reply = await wait_grpc_future(future)
            except grpc.FutureCancelledError:  # close() cancelled it
                self._check_open()
                raise
            except grpc.RpcError as e:
                self._check_open()  # our own cancel (close) is no failure to retry
                self._drop_staged()  # a retry (or the fallback) runs the ordinary way
                code = e.code()
                if code == FULL:  # alive, queue full: not an error, look again
                    leg.release()
                    d.pool.mark_full(worker)
                    tried.append(worker)
                    continue
                leg.abort()  # it may still run there (deadline): drop it
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ProxyError(400, e.details() or "invalid request") from e
                logger.warning("prefill on %s failed: %s %s", worker.address, code, e.details())
                tried.append(worker)
                if code == grpc.StatusCode.UNAVAILABLE:
                    d.pool.mark_failed(worker, f"{code.name}: {e.details()}")
                    d.metrics.failure("prefill_unavailable")
                else:  # slow or failing, not dead: another worker, else decode
                    d.metrics.failure("prefill_error")
                if attempt >= 2 and self._take_fallback():
                    d.metrics.failure("prefill_fallback")
                    return None
                continue
            if self.closed:  # closed as the prefill answered: drop what it kept
                leg.kept_after_abort(reply.kv_transfer_params.transfer_token)
                self._check_open()
            leg.transfer_token = reply.kv_transfer_params.transfer_token  # "": none kept
            try:
                result = prefill_result(reply)
            except ValueError as e:  # a worker that answers this is broken, not busy
                self._drop_staged()
                leg.abort()
                raise ProxyError(
                    500, f"prefill worker {worker.address} sent {e}", kind="prefill_error"
                ) from e
            leg.release()
            d.pool.mark_ok(worker)
            return result

    def _may_stage(self, attempt: int) -> bool:
        """Overlap this request's hand-over with its prefill: only the first attempt, and
        only when a decode leg will follow (more than one token) and the prefill alone
        scores the prompt (prompt logprobs come with its reply)."""
        p = self.params
        return (
            self.d.config.overlap_transfer
            and attempt == 1
            and p.max_tokens > 1
            and p.prompt_logprobs is None
        )

    async def _start_staged(self, prefill: WorkerState, prefill_rid: RequestId, token: str) -> None:
        """Start the decode leg beside the prefill, with staged kv_transfer_params; none
        when no decode worker has room now (the hand-over then waits for the prefill)."""
        d = self.d
        worker = await asyncio.to_thread(d.pool.pick_decode, (), self.prompt_ids)
        if worker is None:
            return
        kv = KVTransferParams.for_staging(prefill_rid, self.prompt_ids, prefill.address, token)
        call = prepare_decode_request(
            self.rid, self.prompt_ids, self.params, None, d.config.failure_policy
        )
        call = dataclasses.replace(call, request_id=f"{self.rid}-ds", kv_transfer_params=kv)
        leg, pump = await self._open_decode_leg(worker, call, with_kv=True)
        self.staged = (worker, call, leg, pump)

    def _drop_staged(self) -> None:
        if self.staged is not None:
            self.staged[2].abort()
            self.staged = None

    def _take_fallback(self) -> bool:
        d = self.d
        if d.fallbacks >= d.config.max_fallback_prefills:
            return False
        d.fallbacks += 1
        self.fallback = True
        return True
