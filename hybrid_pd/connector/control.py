"""gRPC control plane: KVControl server on every worker, and the decode side's client.

Protobuf objects are converted here, at the edge; nothing inward sees them.
"""

from __future__ import annotations

import hmac
import logging
from concurrent import futures

import grpc

from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import GroupGeometry, KVLayout
from hybrid_pd.proto import kv_control_pb2 as pb
from hybrid_pd.proto import kv_control_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SECRET_HEADER = "x-hybrid-pd-secret"


def layout_to_pb(layout: KVLayout) -> pb.Layout:
    return pb.Layout(
        fingerprint=layout.fingerprint,
        block_size=layout.block_size,
        page_size_bytes=layout.page_size_bytes,
        groups=[
            pb.GroupGeometry(
                kind=g.kind,
                spec=g.spec,
                num_layers=g.num_layers,
                slot_bytes=g.slot_bytes,
                blocks_per_state=g.blocks_per_state,
            )
            for g in layout.groups
        ],
        model=layout.model,
    )


def layout_from_pb(msg: pb.Layout) -> KVLayout:
    return KVLayout(
        msg.block_size,
        msg.page_size_bytes,
        tuple(
            GroupGeometry(g.kind, g.spec, g.num_layers, g.slot_bytes, g.blocks_per_state)
            for g in msg.groups
        ),
        msg.model,
    )


class SecretInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the shared secret (logged, never served)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong shared secret")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(SECRET_HEADER, "")
        if hmac.compare_digest(given.encode(), self._secret):
            return continuation(handler_call_details)
        logger.warning("rejected %s: missing or wrong shared secret", handler_call_details.method)
        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny


def make_server(
    address: str, secret: str | None = None, workers: int = 8
) -> tuple[grpc.Server, int]:
    """A gRPC server bound to `address` ("127.0.0.1:0" picks a port); returns (server, port)."""
    interceptors = [SecretInterceptor(secret)] if secret else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=interceptors)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    return server, port


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    return ((SECRET_HEADER, secret),) if secret else ()


class KVControlServicer(pb_grpc.KVControlServicer):
    """Serves a worker's layout and, on prefill workers, its kept KV."""

    def __init__(self, engine_id: str, layout: KVLayout, ucx_address: bytes, prefill=None) -> None:
        self.engine_id = engine_id
        self.layout = layout
        self.ucx_address = ucx_address
        self.prefill = prefill  # PrefillConnector or None

    def Handshake(self, request, context):
        diff = self.layout.difference(layout_from_pb(request.layout))
        if diff:
            logger.warning("refused handshake from %s: %s", request.engine_id, diff)
        return pb.HandshakeReply(
            ok=diff is None,
            error=diff or "",
            engine_id=self.engine_id,
            layout=layout_to_pb(self.layout),
            ucx_address=self.ucx_address,
        )

    def _need_prefill(self, context):
        if self.prefill is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker keeps no KV")

    def PullKV(self, request, context):
        self._need_prefill(context)
        try:
            res = self.prefill.pull(
                request.request_id,
                request.transfer_token,
                [list(g.ids) for g in request.dst_blocks],
                request.ucx_address,
                request.tag,
                timeout=max(1.0, (context.time_remaining() or 30.0) - 0.5),
            )
        except Exception as e:  # reported to the caller; the lease stays until released
            logger.warning("pull of %s failed: %s", request.request_id, e)
            return pb.PullReply(ok=False, error=str(e))
        return pb.PullReply(ok=True, bytes=res.bytes, messages=res.messages)

    def Release(self, request, context):
        self._need_prefill(context)
        try:
            self.prefill.release(request.request_id, request.transfer_token)
        except TransferFailed as e:
            return pb.ReleaseReply(ok=False, error=str(e))
        return pb.ReleaseReply(ok=True)

    def Heartbeat(self, request, context):
        self._need_prefill(context)
        unknown = self.prefill.heartbeat(
            list(zip(request.request_ids, request.transfer_tokens, strict=True))
        )
        return pb.HeartbeatReply(unknown_request_ids=unknown, lease_seconds=self.prefill.lease_s)

    def Abort(self, request, context):
        self._need_prefill(context)
        try:
            self.prefill.release(request.request_id, request.transfer_token, reason="aborted")
        except TransferFailed:
            return pb.AbortReply(ok=False)
        return pb.AbortReply(ok=True)
