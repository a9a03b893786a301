"""One request in the engine, seen from the gRPC server's event loop, and the generation
stream every role answers with.

Handlers never wait for the engine: they post work to the engine loop and await the
request's outputs on an asyncio queue. Requests admitted and still waiting for their first
token are bounded per worker (`max_queued`); past it a call fails fast with
RESOURCE_EXHAUSTED, which the proxy answers by holding the request or trying elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.api.wire import logprob_to_pb, sampling_from_pb
from hybrid_pd.engine.engine import RequestOutput
from hybrid_pd.engine.loop import RequestFailed
from hybrid_pd.kvcache.ids import RequestId
from hybrid_pd.proto import worker_pb2 as pb

if TYPE_CHECKING:
    from hybrid_pd.workers.worker import Worker


class RequestStream:
    """One request in the engine, seen from the event loop: its outputs on a queue."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(item) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
            except RuntimeError:  # the server's loop is closed: nobody listens any more
                pass

        self.sink = sink
        self.request_id: RequestId | None = None
        self.finished = False
        self.queued = False

    async def open(self, *args, **kwargs) -> RequestId:
        """Add the request (`EngineLoop.submit` arguments: prompt ids, SamplingParams, ...;
        ValueError: refused, nothing queued). Its queue slot is taken before the first
        await: the engine thread takes the request only after its current step, and calls
        arriving meanwhile must already see the slot taken. A constrained request's grammar
        is compiled first, off the engine thread (ValueError when it does not compile)."""
        self.queued = True
        self.w.queued += 1
        fut = None
        try:
            params = args[1]
            if params.constraint is not None:
                # compiled here, in a thread: a large schema never holds up the engine's
                # steps (the cache makes a repeated one free)
                grammars = self.w.loop.engine.grammars
                kwargs["grammar"] = await asyncio.to_thread(grammars.compile, params.constraint)
            fut = self.w.loop.submit(*args, sink=self.sink, **kwargs)
            self.request_id = RequestId(await asyncio.wrap_future(fut))
        except BaseException:
            self._unqueue()
            if fut is None:
                raise
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
            for role in self.w.roles:
                fut.add_done_callback(
                    lambda f, role=role: f.exception() is None and role.dropped(f.result())
                )


async def open_stream(worker: Worker, context, *args, **kwargs) -> RequestStream:
    """Admit a request to `worker`'s engine (`EngineLoop.submit` arguments), or end the call:
    RESOURCE_EXHAUSTED when the queue is full, INVALID_ARGUMENT when the engine refuses
    it, UNAVAILABLE when the loop is stopping."""
    if worker.queued >= worker.config.max_queued:
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"worker queue is full ({worker.config.max_queued} requests waiting)",
        )
    stream = RequestStream(worker)
    try:
        await stream.open(*args, **kwargs)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except RuntimeError as e:  # the loop is stopping
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    return stream


async def sampling_of(msg: pb.Sampling, context) -> SamplingParams:
    """The request's sampling parameters, or INVALID_ARGUMENT."""
    try:
        return sampling_from_pb(msg)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def local_kwargs(request: pb.GenerateRequest) -> dict:
    """`EngineLoop.submit` keywords of a Generate that brings no KV: a continuation
    (`output_ids`: a migrated stream recomputed here) or a fresh request."""
    return {"output_ids": list(request.output_ids)} if request.output_ids else {}


async def stream_generation(
    worker: Worker,
    context,
    prompt: list[int],
    params: SamplingParams,
    request_id: str | None,
    kwargs: dict,
) -> AsyncIterator[pb.GenerateChunk]:
    """Admit one request and stream its chunks: the first with the transfer's figures,
    then the new tokens of each output, until it finishes (an engine error ends the stream
    with a chunk whose finish_reason is "error")."""
    stream = await open_stream(worker, context, prompt, params, request_id, **kwargs)
    timeout = worker.config.request_timeout_s
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
            logprobs=logprobs_pb(out, 0),
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
                logprobs=logprobs_pb(out, sent),
            )
            sent = len(out.token_ids)
    finally:
        stream.close()


def logprobs_pb(out: RequestOutput, start: int) -> list[pb.TokenLogprob]:
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
