"""The decode role's RPCs: Generate (a request whose KV a prefill worker holds, or one that
brings none) and AddPeers (prefill workers it may pull from).

    Generate(prompt, kv_transfer_params) ──► DecodeRole.request_kwargs (checks, failure
    policy) ──► the engine's queue (remote_kv) ──► chunks streamed as the engine makes them
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.workers.stream import local_kwargs, sampling_of, stream_generation

if TYPE_CHECKING:
    from hybrid_pd.decode_worker.role import DecodeRole
    from hybrid_pd.workers.worker import Worker


class DecodeService:
    def __init__(self, worker: Worker, role: DecodeRole) -> None:
        self.w = worker
        self.role = role

    async def Generate(self, request, context):
        params = await sampling_of(request.sampling, context)
        prompt = list(request.prompt_ids)
        rid = request.request_id or None
        if request.HasField("kv_transfer_params"):
            if request.output_ids:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "output_ids and kv_transfer_params exclude each other",
                )
            try:
                kv_rid, kwargs = self.role.request_kwargs(
                    KVTransferParams.from_pb(request.kv_transfer_params),
                    prompt,
                    request.failure_policy,
                )
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            rid = rid or kv_rid
        else:
            kwargs = local_kwargs(request)
        async for chunk in stream_generation(self.w, context, prompt, params, rid, kwargs):
            yield chunk

    async def AddPeers(self, request, context):
        self.role.connector.add_peers(list(request.prefill_addresses))
        return pb.AddPeersReply(known=self.role.connector.known_peers)
