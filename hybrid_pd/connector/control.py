"""gRPC control plane: the server every worker runs (grpc.aio), the KVControl service, and
the decode side's client helpers.

No thread is held per open call: open Generate streams are coroutines waiting on queues, so
Health, Stats and the KV control calls that free blocks are answered however many streams are
open. A call that waits for a request's state (Progress, a pull that came before its keep)
awaits the prefill connector's change events (`watch.until`): nothing polls, no thread waits.
Blocking work (UCX sends) runs in an executor, never on the event loop. Protobuf objects
are converted here, at the edge; nothing inward sees them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc

from hybrid_pd.api.wire import same_named
from hybrid_pd.connector import timeline
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import GroupGeometry, KVLayout
from hybrid_pd.connector.prefill_stage import PullOrder
from hybrid_pd.connector.watch import until
from hybrid_pd.kvcache.ids import EngineId, RequestId
from hybrid_pd.kvcache.tp_layout import SlotRows
from hybrid_pd.proto import kv_control_pb2 as pb
from hybrid_pd.proto import kv_control_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SECRET_HEADER = "x-hybrid-pd-secret"
#: Progress long-polls: the longest a call waits for the prefill's state to move.
PROGRESS_WAIT_MAX_S = 10.0


#: `GroupGeometry` and `SlotRows` fields their proto messages hold alike.
_GROUP_AS_IS = ("kind", "spec", "num_layers", "slot_bytes", "blocks_per_state")
_ROWS_AS_IS = ("offset", "row_bytes")


def layout_to_pb(layout: KVLayout) -> pb.Layout:
    def rows(r: SlotRows) -> pb.SlotRows:
        segments = [pb.RowSegment(units=u, width=w, replicate=rep) for u, w, rep in r.segments]
        return pb.SlotRows(**same_named(r, _ROWS_AS_IS), segments=segments, lines=r.lines)

    return pb.Layout(
        fingerprint=layout.fingerprint,
        block_size=layout.block_size,
        page_size_bytes=layout.page_size_bytes,
        groups=[
            pb.GroupGeometry(**same_named(g, _GROUP_AS_IS), rows=[rows(r) for r in g.rows])
            for g in layout.groups
        ],
        model=layout.model,
        tp_size=layout.tp_size,
    )


def layout_from_pb(msg: pb.Layout) -> KVLayout:
    def rows(r: pb.SlotRows) -> SlotRows:
        segments = tuple((s.units, s.width, s.replicate) for s in r.segments)
        return SlotRows(**same_named(r, _ROWS_AS_IS), segments=segments, lines=r.lines or 1)

    groups = tuple(
        GroupGeometry(**same_named(g, _GROUP_AS_IS), rows=tuple(rows(r) for r in g.rows))
        for g in msg.groups
    )
    return KVLayout(msg.block_size, msg.page_size_bytes, groups, msg.model, msg.tp_size or 1)


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the shared secret (logged, never served)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shared secret")

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shared secret")
            yield  # never reached: abort raises

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(SECRET_HEADER, "")
        if isinstance(given, bytes):
            given = given.decode(errors="replace")
        if hmac.compare_digest(given.encode(), self._secret):
            return await continuation(handler_call_details)
        logger.warning("rejected %s: missing or wrong shared secret", handler_call_details.method)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny


class AioServer:
    """grpc.aio server bound to `address` ("127.0.0.1:0" picks a port), served by an event
    loop on a thread of its own. `add(register)` installs servicers before `start`."""

    def __init__(self, address: str, secret: str | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve_loop, name="grpc-aio", daemon=True)
        self._thread.start()
        self.server, self.port = self.run(self._make(address, secret))

    def _serve_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _make(self, address: str, secret: str | None) -> tuple[grpc.aio.Server, int]:
        interceptors = [SecretInterceptor(secret)] if secret else []
        server = grpc.aio.server(interceptors=interceptors)
        port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind gRPC server to {address}")
        return server, port

    def run(self, coro: Awaitable[Any], timeout: float | None = 30.0) -> Any:
        """Run a coroutine on the server's loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, register: Callable[[grpc.aio.Server], None]) -> None:
        async def do() -> None:
            register(self.server)

        self.run(do())

    def start(self) -> None:
        self.run(self.server.start())

    def stop(self, grace: float = 1.0) -> None:
        if not self.loop.is_running():
            return
        try:
            self.run(self.server.stop(grace), timeout=grace + 10)
        except Exception:  # already stopped, or the loop is wedged: stop the loop anyway
            logger.exception("gRPC server stop failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    return ((SECRET_HEADER, secret),) if secret else ()


class KVControlServicer(pb_grpc.KVControlServicer):
    """Serves a worker's layout and, on prefill workers, its kept KV (async handlers)."""

    def __init__(
        self,
        engine_id: EngineId,
        layout: KVLayout,
        ucx_address: bytes,
        prefill=None,
        max_parallel_sends: int = 16,
    ) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.ucx_address = ucx_address
        self.prefill = prefill  # PrefillConnector or None
        self._sends = ThreadPoolExecutor(max_parallel_sends, thread_name_prefix="kv-send")

    async def Handshake(self, request, context):
        peer = layout_from_pb(request.layout)
        diff = self.layout.difference(peer)
        if diff is None and self.prefill is not None:
            diff = self.prefill.refusal(peer)
        if diff:
            logger.warning("refused handshake from %s: %s", request.engine_id, diff)
        elif request.ucx_address and self.prefill is not None:
            self._connect(request.ucx_address)
        memory = None
        if diff is None and self.prefill is not None:  # mapped at the first handshake
            memory = await asyncio.get_running_loop().run_in_executor(
                None, self.prefill.remote_memory
            )
        return pb.HandshakeReply(
            ok=diff is None,
            error=diff or "",
            engine_id=self.engine_id,
            layout=layout_to_pb(self.layout),
            ucx_address=self.ucx_address,
            scatter_gather=True,
            remote_memory=memory,
        )

    def _connect(self, peer: bytes) -> None:
        """Make the UCX endpoint to a decode worker that just shook hands, in the
        background: its first pull then does not wait for UCX's wire-up."""
        connect = getattr(self.prefill.transport, "connect", None)
        if connect is None:
            return
        try:
            connect(peer).add_done_callback(_log_connect_error)
        except Exception as e:  # the first send makes it then
            logger.debug("UCX endpoint to a new decode worker not made early: %s", e)

    async def _need_prefill(self, context):
        if self.prefill is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker keeps no KV")

    async def PullKV(self, request, context):
        await self._need_prefill(context)
        remaining = context.time_remaining()
        timeout = max(1.0, (remaining if remaining is not None else 30.0) - 0.5)
        dst = [list(g.ids) for g in request.dst_blocks]
        dst_layout = layout_from_pb(request.dst_layout) if request.HasField("dst_layout") else None
        rid = RequestId(request.request_id)
        if request.read_done:
            return await self._confirm_read(request, rid, dst, dst_layout, timeout)
        if request.per_rank:
            return pb.PullReply(
                ok=False, error="a decode rank's own pieces are read one-sided, never sent"
            )
        if request.stage_epoch:
            send = partial(
                self.prefill.pull_stage,
                rid,
                request.transfer_token,
                request.stage_epoch,
                list(request.skip_blocks),
                list(request.stage_end),
            )
        else:
            # A pull may come before its request's keep (vLLM keeps at its next step): await
            # the keep here, then send on the executor without waiting there.
            timeline.stamp(rid, "pull_received")
            wait = self.prefill.keep_wait(timeout)
            if wait > 0:
                settled = partial(self.prefill.settled, rid)
                await until(self.prefill.watchers, rid, lambda: (settled(), None), wait)
            timeline.stamp(rid, "keep_present")
            send = partial(
                self.prefill.pull,
                rid,
                request.transfer_token,
                skip=list(request.skip_blocks),
                wait_for_keep=False,
            )
        what = dict(
            dst_blocks=dst,
            peer=request.ucx_address,
            tag=request.tag,
            timeout=timeout,
            message_regions=list(request.message_regions),
            dst_layout=dst_layout,
        )
        try:
            if not request.stage_epoch and hasattr(self.prefill.transport, "send_future"):
                # posted from this loop and awaited here: no send thread to wake
                order = PullOrder(
                    rid, request.transfer_token, skip=list(request.skip_blocks), **what
                )
                res = await self.prefill.pull_async(order)
            else:
                res = await asyncio.get_running_loop().run_in_executor(
                    self._sends, lambda: send(**what)
                )
        except Exception as e:  # reported to the caller; the lease stays until released
            logger.warning("pull of %s failed: %s", request.request_id, e)
            return pb.PullReply(ok=False, error=str(e))
        return pb.PullReply(ok=True, bytes=res.bytes, messages=res.messages)

    async def _confirm_read(self, request, rid, dst, dst_layout, timeout: float):
        """PullKV with read_done: decode read the blocks one-sided; confirm they were kept."""
        try:
            if request.stage_epoch:
                res = self.prefill.confirm_stage_read(
                    rid,
                    request.transfer_token,
                    request.stage_epoch,
                    list(request.skip_blocks),
                    list(request.stage_end),
                    dst,
                    dst_layout,
                )
            else:
                wait = self.prefill.keep_wait(timeout)  # vLLM keeps at its next step
                if wait > 0:
                    settled = partial(self.prefill.settled, rid)
                    await until(self.prefill.watchers, rid, lambda: (settled(), None), wait)
                res = self.prefill.confirm_read(
                    rid,
                    request.transfer_token,
                    dst,
                    list(request.skip_blocks),
                    dst_layout,
                    request.dst_rank if request.per_rank else None,
                )
        except TransferFailed as e:
            logger.warning("one-sided pull of %s refused: %s", request.request_id, e)
            return pb.PullReply(ok=False, error=str(e))
        return pb.PullReply(ok=True, bytes=res.bytes, messages=res.messages)

    async def Release(self, request, context):
        await self._need_prefill(context)
        try:
            self.prefill.release(RequestId(request.request_id), request.transfer_token)
        except TransferFailed as e:
            return pb.ReleaseReply(ok=False, error=str(e))
        return pb.ReleaseReply(ok=True)

    async def Heartbeat(self, request, context):
        await self._need_prefill(context)
        unknown = self.prefill.heartbeat(
            list(zip(request.request_ids, request.transfer_tokens, strict=True))
        )
        return pb.HeartbeatReply(unknown_request_ids=unknown, lease_seconds=self.prefill.lease_s)

    async def Abort(self, request, context):
        await self._need_prefill(context)
        try:
            rid = RequestId(request.request_id)
            self.prefill.release(rid, request.transfer_token, reason="aborted")
        except TransferFailed:
            return pb.AbortReply(ok=False)
        return pb.AbortReply(ok=True)

    async def Progress(self, request, context):
        """Long-poll: answer once `min_tokens` are computed, the prefill ended, or `wait_s`
        (at most PROGRESS_WAIT_MAX_S) passed. Awaits the request's change events (the
        engine's step publishing progress, a preemption, the keep, the end): no poll."""
        await self._need_prefill(context)
        rid, token = RequestId(request.request_id), request.transfer_token

        def look():
            p = self.prefill.progress(rid, token)
            done = p.state in ("kept", "ended") or (
                p.state == "running" and p.computed >= request.min_tokens
            )
            return done, p

        wait = min(max(request.wait_s, 0.0), PROGRESS_WAIT_MAX_S)
        try:
            p = await until(self.prefill.watchers, rid, look, wait)
        except TransferFailed as e:
            return pb.ProgressReply(ok=False, error=str(e))
        kept = p.state == "kept"
        return pb.ProgressReply(
            ok=True,
            state=p.state,
            epoch=p.epoch,
            computed_tokens=p.computed,
            block_ids=[pb.BlockIds(ids=g) for g in p.block_ids],
            first_token=p.first_token,
            engine_id=self.prefill.engine_id if kept else "",
            fingerprint=self.prefill.layout.fingerprint if kept else "",
        )


def _log_connect_error(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug("UCX endpoint to a new decode worker not made early: %s", future.exception())
