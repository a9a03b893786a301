"""Client of the Worker gRPC service (what a proxy uses)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from hybrid_pd.api.ids import RequestId
from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.sampling import TokenLogprob
from hybrid_pd.api.wire import logprob_from_pb
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc

SECRET_HEADER = "x-hybrid-pd-secret"


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    finished: bool
    finish_reason: str
    kv_transfer_params: KVTransferParams | None
    #: When the sampling asked for them: the first token's, and the prompt's (first None).
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class GenerateResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    transfer: dict = field(default_factory=dict)


class WorkerClient:
    def __init__(self, address: str, secret: str | None = None, timeout_s: float = 300.0):
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._metadata = ((SECRET_HEADER, secret),) if secret else ()
        self.timeout_s = timeout_s

    def close(self) -> None:
        self._channel.close()

    def _call(self, rpc: Callable[..., Any], request: Message, timeout_s: float | None) -> Any:
        """`rpc` (a stub method, or its ``.future``) with `request`, this client's deadline
        (`timeout_s`, else its default) and secret."""
        return rpc(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)

    def prefill_future(
        self,
        request_id: RequestId,
        prompt_ids: list[int],
        sampling: pb.Sampling,
        timeout_s: float | None = None,
        transfer_token: str = "",
    ) -> grpc.Future:
        """Non-blocking Prefill: a grpc.Future of the PrefillReply (`prefill_result` parses
        it); cancelling the future cancels the RPC, which drops the request on the worker.
        `transfer_token`: a decode worker showing it may follow the prefill (overlap)."""
        request = _prefill_request(request_id, prompt_ids, sampling, transfer_token)
        return self._call(self._stub.Prefill.future, request, timeout_s)

    def prefill(self, *args: Any, **kwargs: Any) -> PrefillResult:
        """`prefill_future`'s call (the same arguments), waited for: its parsed reply. An
        RPC error raises as the blocking call's would (a grpc.RpcError with its code)."""
        return prefill_result(self.prefill_future(*args, **kwargs).result())

    def generate_stream(
        self,
        request_id: RequestId,
        prompt_ids: list[int],
        sampling: pb.Sampling,
        kv_transfer_params: KVTransferParams | None = None,
        failure_policy: str = "",
        timeout_s: float | None = None,
        output_ids: list[int] | tuple[int, ...] = (),
    ) -> Iterator[pb.GenerateChunk]:
        """The stream of chunks; it is also a grpc.Call: `.cancel()` ends it (and the request
        on the worker)."""
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            kv_transfer_params=kv_transfer_params.to_pb() if kv_transfer_params else None,
            failure_policy=failure_policy,
            output_ids=list(output_ids),
        )
        return self._call(self._stub.Generate, request, timeout_s)

    def generate(self, *args, **kwargs) -> GenerateResult:
        out = GenerateResult()
        for chunk in self.generate_stream(*args, **kwargs):
            out.token_ids += list(chunk.token_ids)
            if chunk.HasField("transfer") and not out.transfer:
                out.transfer = _scalars(chunk.transfer)
            if chunk.finished:
                out.finish_reason = chunk.finish_reason
                out.error = chunk.error
        return out

    def abort(
        self, request_id: RequestId, timeout_s: float | None = None, transfer_token: str = ""
    ) -> bool:
        request = pb.AbortRequest(request_id=request_id, transfer_token=transfer_token)
        return self._call(self._stub.Abort, request, timeout_s).ok

    def add_peers(self, addresses: list[str], timeout_s: float | None = None) -> list[str]:
        """Tell a decode worker which prefill workers it may pull from; returns all it knows."""
        request = pb.AddPeersRequest(prefill_addresses=addresses)
        return list(self._call(self._stub.AddPeers, request, timeout_s).known)

    def health(self, timeout_s: float | None = None) -> pb.HealthReply:
        return self._call(self._stub.Health, pb.HealthRequest(), timeout_s)

    def describe(self, timeout_s: float | None = None) -> pb.ModelCard:
        """What the worker serves (its model card)."""
        return self._call(self._stub.Describe, pb.DescribeRequest(), timeout_s)

    def stats(self, timeout_s: float | None = None) -> dict:
        """The worker's Stats as a dict (`stats_from_pb`)."""
        return stats_from_pb(self._call(self._stub.Stats, pb.StatsRequest(), timeout_s))


def prefill_result(reply: pb.PrefillReply) -> PrefillResult:
    """The reply, its kv_transfer_params parsed (ValueError when they are malformed)."""
    kv = None
    if reply.HasField("kv_transfer_params"):
        kv = KVTransferParams.from_pb(reply.kv_transfer_params)
    first = logprob_from_pb(reply.first_logprob) if reply.HasField("first_logprob") else None
    prompt = [logprob_from_pb(lp) for lp in reply.prompt_logprobs] or None
    return PrefillResult(reply.first_token, reply.finished, reply.finish_reason, kv, first, prompt)


def stats_from_pb(reply: pb.StatsReply) -> dict:
    """The typed StatsReply as the dict a worker's `stats()` returns: its scalar fields, the
    role sections only for the worker's roles (`leases` and `prefill_connector` on prefill,
    `peers` and `decode_connector` on decode), `transport`."""
    out = _scalars(reply)
    out["transport"] = _scalars(reply.transport)
    if reply.HasField("prefill"):
        out["leases"] = reply.prefill.leases
        out["prefill_connector"] = _scalars(reply.prefill.connector)
    if reply.HasField("decode"):
        out["peers"] = list(reply.decode.peers)
        out["decode_connector"] = _scalars(reply.decode.connector)
        out["decode_connector"]["bytes_by_rank"] = list(reply.decode.connector.bytes_by_rank)
    return out


def _scalars(msg: Message) -> dict:
    return {
        f.name: getattr(msg, f.name)
        for f in msg.DESCRIPTOR.fields
        if f.type != f.TYPE_MESSAGE and not f.is_repeated
    }


def _prefill_request(
    request_id: RequestId, prompt_ids: list[int], sampling: pb.Sampling, transfer_token: str
) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        sampling=sampling,
        transfer_token=transfer_token,
    )
