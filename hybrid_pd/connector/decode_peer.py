"""What a decode worker holds of a prefill worker it pulls from, and the small results of
talking to one (shared by the ordinary and the staged load paths)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.kvcache.ids import EngineId
from hybrid_pd.proto import kv_control_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    messages: int
    seconds: float


@dataclass
class Peer:
    """A prefill worker after a handshake that agreed on the layouts."""

    channel: grpc.Channel
    stub: pb_grpc.KVControlStub
    ucx_address: bytes
    engine_id: EngineId
    scatter_gather: bool  # takes several regions per message (PullRequest.message_regions)
    layout: KVLayout | None = None
    #: The transfer plan between its pools and ours (tensor-parallel pairs; else ours).
    plan: object = None
    #: Its memory, readable one-sided (`connector.onesided.RemoteMemory`); None: it sends.
    remote: object = None


class Refused(Exception):
    """The prefill worker refused or voided a pull (a staged pull: its blocks changed)."""


def rpc_error(e: grpc.RpcError) -> str:
    """A failed call, said in one line: status code and details."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'error'}: {details}"
