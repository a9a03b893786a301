"""What the scheduler half hands the worker half each step, and the handshake it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.kvcache.ids import RequestId


@dataclass(frozen=True)
class Send:
    request_id: RequestId
    token: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Load:
    request_id: RequestId
    params: KVTransferParams
    block_ids: tuple[tuple[int, ...], ...]


@dataclass
class HybridPDMetadata(KVConnectorMetadata):
    sends: list[Send] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    #: Params handed over but never loaded here: the prefill worker may free them now.
    drops: list[KVTransferParams] = field(default_factory=list)
    #: The step computes nothing (vLLM steps idle while hand-offs are in flight).
    idle: bool = False


@dataclass
class HybridPDHandshake(KVConnectorHandshakeMetadata):
    control_address: str
