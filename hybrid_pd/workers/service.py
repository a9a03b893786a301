"""The Worker gRPC service (async): the RPCs every worker answers (Abort, Stats, Health,
Describe) and the defaults of the role RPCs, which the worker's roles replace with their own
(`Role.rpcs`): Prefill (prefill_worker/), Generate with KV from a prefill worker and
AddPeers (decode_worker/). Without a decode role, Generate still runs a request that
brings no KV (a fresh or migrated stream)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from hybrid_pd.api.wire import card_to_pb
from hybrid_pd.kvcache.ids import RequestId
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
from hybrid_pd.workers.role import Handler
from hybrid_pd.workers.stream import local_kwargs, sampling_of, stream_generation

if TYPE_CHECKING:
    from hybrid_pd.workers.worker import Worker


class WorkerServicer(pb_grpc.WorkerServicer):
    """`rpcs`: the roles' handlers by RPC name; each replaces the default method."""

    def __init__(self, worker: Worker, rpcs: dict[str, Handler]) -> None:
        self.w = worker
        for name, handler in rpcs.items():
            if not hasattr(pb_grpc.WorkerServicer, name):
                raise ValueError(f"the Worker service has no RPC {name!r}")
            setattr(self, name, handler)

    # -- role RPCs: a worker without the role ------------------------------------------------
    async def Prefill(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a prefill worker")

    async def Generate(self, request, context):
        params = await sampling_of(request.sampling, context)
        if request.HasField("kv_transfer_params"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
        rid = request.request_id or None
        async for chunk in stream_generation(
            self.w, context, list(request.prompt_ids), params, rid, local_kwargs(request)
        ):
            yield chunk

    async def AddPeers(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")

    # -- every worker ------------------------------------------------------------------------
    async def Abort(self, request, context):
        """Abort a request wherever it is: queued, running, or kept for a decode worker.

        Only holders of the control-plane secret (checked by the server's interceptor) may
        abort by id. A worker running without a secret (--insecure) aborts nothing by id;
        it drops a kept request only for the caller that shows its transfer token."""
        if not self.w.config.secret:
            ok = False
            if request.transfer_token:
                ok = any(
                    role.abort_with_token(request.request_id, request.transfer_token)
                    for role in self.w.roles
                )
            if not ok:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "Abort needs the control-plane secret or the request's transfer token "
                    "(cancel your own call to stop it)",
                )
            return pb.AbortReply(ok=True)
        # shielded: the abort completes even if its caller stops waiting for the answer
        rid = RequestId(request.request_id)
        found = await asyncio.shield(asyncio.ensure_future(self._abort(rid)))
        return pb.AbortReply(ok=found)

    async def _abort(self, request_id: RequestId) -> bool:
        req = await asyncio.wrap_future(self.w.loop.abort(request_id))
        found = req is not None
        for role in self.w.roles:
            role.dropped(req)
        for role in self.w.roles:
            found = role.abort(request_id) or found
        return found

    async def Stats(self, request, context):
        return stats_to_pb(self.w.stats())

    async def Describe(self, request, context):
        return card_to_pb(self.w.card)

    async def Health(self, request, context):
        return pb.HealthReply(
            engine_id=self.w.engine_id,
            role=self.w.config.role,
            queued=self.w.queued,
            max_queued=self.w.config.max_queued,
        )


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
