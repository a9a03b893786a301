"""The Worker gRPC service (async): Prefill, Generate, Abort, Stats, Health, Describe.

Handlers never wait for the engine: they post work to the engine loop and await the
request's outputs on an asyncio queue. Requests admitted and still waiting for their first
token are bounded per worker (`max_queued`); past it a call fails fast with
RESOURCE_EXHAUSTED, which the proxy answers by holding the request or trying elsewhere.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.api.wire import card_to_pb, logprob_to_pb, sampling_from_pb
from hybrid_pd.engine.engine import RequestOutput
from hybrid_pd.engine.loop import RequestFailed
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class RequestStream:
    """One request in the engine, seen from the event loop: its outputs on a queue."""

    def __init__(self, worker) -> None:
        self.w = worker
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(item) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the server's loop is closed: nobody listens any more
                pass

        self.sink = sink
        self.request_id: str | None = None
        self.finished = False
        self.queued = False

    async def open(self, *args, **kwargs) -> str:
        """Add the request (ValueError: refused, nothing queued). Its queue slot is taken
        before the first await: the engine thread takes the request only after its current
        step, and calls arriving meanwhile must already see the slot taken."""
        self.queued = True
        self.w.queued += 1
        fut = self.w.loop.submit(*args, sink=self.sink, **kwargs)
        try:
            self.request_id = await asyncio.wrap_future(fut)
        except BaseException:
            self._unqueue()
            # Cancelled (the client left) after the engine took it: drop it there too.
            fut.add_done_callback(
                lambda f: (
                    f.cancelled() or f.exception() is not None or self.w.loop.abort(f.result())
                )
            )
            raise
        return self.request_id

    async def next(self, timeout: float) -> RequestOutput:
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            raise RequestFailed(f"no output within {timeout:.0f} s") from None
        self._unqueue()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def _unqueue(self) -> None:
        if self.queued:
            self.queued = False
            self.w.queued -= 1

    def close(self) -> None:
        """Drop the request from the engine unless it finished (client gone, error)."""
        self._unqueue()
        if self.request_id is not None and not self.finished:
            self.finished = True
            fut = self.w.loop.abort(self.request_id)
            if self.w.decode is not None:
                fut.add_done_callback(
                    lambda f: f.exception() is None and self.w.decode.dropped(f.result())
                )


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, worker) -> None:
        self.w = worker

    async def _open(self, context, *args, **kwargs) -> RequestStream:
        if self.w.queued >= self.w.config.max_queued:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker queue is full ({self.w.config.max_queued} requests waiting)",
            )
        stream = RequestStream(self.w)
        try:
            await stream.open(*args, **kwargs)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:  # the loop is stopping
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return stream

    # -- prefill ----------------------------------------------------------------------------
    async def Prefill(self, request, context):
        if self.w.prefill is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a prefill worker")
        params = await _sampling(request.sampling, context)
        if len(request.transfer_token) > 256:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_token is too long")
        stream = await self._open(
            context,
            list(request.prompt_ids),
            params,
            request.request_id or None,
            remote_decode=True,
            stage_token=request.transfer_token or None,
        )
        try:
            out = await stream.next(self.w.config.request_timeout_s)
        except RequestFailed as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e}")
        finally:
            stream.close()
        kv = out.kv_transfer_params  # the prefill connector's dict (engine contract)
        reply = pb.PrefillReply(
            first_token=out.token_ids[0],
            finished=kv is None,
            finish_reason=out.finish_reason or "",
        )
        if kv is not None:
            reply.kv_transfer_params.CopyFrom(KVTransferParams.from_dict(kv).to_pb())
        if out.logprobs is not None:
            reply.first_logprob.CopyFrom(logprob_to_pb(out.logprobs[0]))
        if out.prompt_logprobs is not None:
            reply.prompt_logprobs.extend(logprob_to_pb(lp) for lp in out.prompt_logprobs)
        return reply

    # -- generate ---------------------------------------------------------------------------
    async def Generate(self, request, context):
        params = await _sampling(request.sampling, context)
        prompt = list(request.prompt_ids)
        rid = request.request_id or None
        kwargs: dict = {}
        if request.HasField("kv_transfer_params"):
            if self.w.decode is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
            if request.output_ids:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "output_ids and kv_transfer_params exclude each other",
                )
            try:
                kv_rid, kwargs = self.w.decode.request_kwargs(
                    KVTransferParams.from_pb(request.kv_transfer_params),
                    prompt,
                    request.failure_policy,
                )
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            rid = rid or kv_rid
        elif request.output_ids:
            kwargs = {"output_ids": list(request.output_ids)}
        stream = await self._open(context, prompt, params, rid, **kwargs)
        timeout = self.w.config.request_timeout_s
        try:
            try:
                out = await stream.next(timeout)
            except RequestFailed as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            if out.finish_reason == "error":  # the KV load failed under policy "fail"
                # ABORTED, not UNAVAILABLE: this worker is alive; the proxy must not
                # treat it as dead (or migrate the request).
                await context.abort(grpc.StatusCode.ABORTED, out.error or "KV load failed")
            first = pb.GenerateChunk(
                token_ids=out.token_ids,
                finished=out.finished,
                finish_reason=out.finish_reason or "",
                logprobs=_logprobs_pb(out, 0),
            )
            first.transfer.CopyFrom(_transfer_pb(out))
            if out.prompt_logprobs is not None:
                first.prompt_logprobs.extend(logprob_to_pb(lp) for lp in out.prompt_logprobs)
            yield first
            sent = len(out.token_ids)
            while not out.finished:
                try:
                    out = await stream.next(timeout)
                except RequestFailed as e:
                    yield pb.GenerateChunk(finished=True, finish_reason="error", error=str(e))
                    return
                yield pb.GenerateChunk(
                    token_ids=out.token_ids[sent:],
                    finished=out.finished,
                    finish_reason=out.finish_reason or "",
                    error=out.error or "",
                    logprobs=_logprobs_pb(out, sent),
                )
                sent = len(out.token_ids)
        finally:
            stream.close()

    async def Abort(self, request, context):
        """Abort a request wherever it is: queued, running, or kept for a decode worker.

        Only holders of the control-plane secret (checked by the server's interceptor) may
        abort by id. A worker running without a secret (--insecure) aborts nothing by id;
        it drops a kept request only for the caller that shows its transfer token."""
        if not self.w.config.secret:
            ok = False
            if self.w.prefill is not None and request.transfer_token:
                ok = self.w.prefill.abort_with_token(request.request_id, request.transfer_token)
            if not ok:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "Abort needs the control-plane secret or the request's transfer token "
                    "(cancel your own call to stop it)",
                )
            return pb.AbortReply(ok=True)
        # shielded: the abort completes even if its caller stops waiting for the answer
        found = await asyncio.shield(asyncio.ensure_future(self._abort(request.request_id)))
        return pb.AbortReply(ok=found)

    async def _abort(self, request_id: str) -> bool:
        req = await asyncio.wrap_future(self.w.loop.abort(request_id))
        found = req is not None
        if self.w.decode is not None:
            self.w.decode.dropped(req)
        if self.w.prefill is not None:
            found = self.w.prefill.abort(request_id) or found
        return found

    async def Stats(self, request, context):
        return stats_to_pb(self.w.stats())

    async def AddPeers(self, request, context):
        if self.w.decode is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
        self.w.decode.connector.add_peers(list(request.prefill_addresses))
        return pb.AddPeersReply(known=self.w.decode.connector.known_peers)

    async def Describe(self, request, context):
        return card_to_pb(self.w.card)

    async def Health(self, request, context):
        return pb.HealthReply(
            engine_id=self.w.engine_id,
            role=self.w.config.role,
            queued=self.w.queued,
            max_queued=self.w.config.max_queued,
        )


async def _sampling(msg: pb.Sampling, context) -> SamplingParams:
    try:
        return sampling_from_pb(msg)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def stats_to_pb(stats: dict) -> pb.StatsReply:
    """`Worker.stats()` as the typed reply. A key the schema lacks raises ValueError (the
    proto and the dict must change together)."""
    flat = {k: v for k, v in stats.items() if k not in _SECTIONS}
    reply = pb.StatsReply(**flat, transport=pb.TransportStats(**stats["transport"]))
    if "prefill_connector" in stats:
        reply.prefill.CopyFrom(
            pb.PrefillRoleStats(
                leases=stats["leases"],
                connector=pb.PrefillConnectorStats(**stats["prefill_connector"]),
            )
        )
    if "decode_connector" in stats:
        reply.decode.CopyFrom(
            pb.DecodeRoleStats(
                peers=stats["peers"],
                connector=pb.DecodeConnectorStats(**stats["decode_connector"]),
            )
        )
    return reply


#: Keys of `Worker.stats()` that go to the reply's sub-messages.
_SECTIONS = ("transport", "leases", "prefill_connector", "peers", "decode_connector")


def _logprobs_pb(out: RequestOutput, start: int) -> list[pb.TokenLogprob]:
    if out.logprobs is None:
        return []
    return [logprob_to_pb(lp) for lp in out.logprobs[start:]]


def _transfer_pb(out: RequestOutput) -> pb.TransferStats:
    res = out.load_result
    if res is None:
        return pb.TransferStats(recomputed=out.recomputed)
    if out.recomputed:
        return pb.TransferStats(recomputed=True)
    return pb.TransferStats(
        bytes=res.bytes,
        messages=res.messages,
        seconds=res.seconds,
        held_tokens=out.num_cached_tokens,
        staged_bytes=res.staged_bytes,
    )
