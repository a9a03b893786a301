"""What a decode worker holds of a prefill worker it pulls from, and the small results of
talking to one (shared by the ordinary and the staged load paths); `PeerBook`, the decode
connector's half that admits, dials (handshakes) and forgets prefill workers."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from hybrid_pd.connector import onesided
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.control import layout_from_pb, layout_to_pb
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.tp_plan import ShardedPlan
from hybrid_pd.kvcache.ids import EngineId
from hybrid_pd.proto import kv_control_pb2 as pb
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


class PeerBook:
    """The decode connector's prefill workers: which it may dial (`admission`), their
    handshakes and plans, and the channels it keeps (`DecodeConnector` holds the state:
    `_peers`, `_bare`, `_lock`, `admission`, `layout`, `transport`, `_plan`,
    `_rank_plans`, `_shard_buffers`, `one_sided`, `timeout_s`, `_metadata`, `engine_id`)."""

    def add_peers(self, addresses) -> None:
        """Prefill workers (control addresses) this worker may dial from now on."""
        self.admission.add(addresses)

    @property
    def known_peers(self) -> list[str]:
        return self.admission.known

    def pull_kind(self, address: str) -> str | None:
        """How pulls from the prefill worker at `address` move bytes: "sent" (two-sided),
        "read" (one-sided, this process copies: same host), "ucx-read" (one-sided through
        UCX); None before its handshake."""
        with self._lock:
            peer = self._peers.get(address)
        if peer is None:
            return None
        if peer.remote is None:
            return "sent"
        return "read" if peer.remote.pid else "ucx-read"

    def _peer(self, address: str) -> Peer:
        with self._lock:
            peer = self._peers.get(address)
        if peer is not None:
            return peer
        if not self.admission.may_dial(address):
            # Never dial (and send the secret to) an address taken from a request.
            raise TransferFailed(
                f"{address} is not a known prefill worker of this decode worker "
                "(peers come from the proxy's registry or --peer)"
            )
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.KVControlStub(channel)
        try:
            reply = stub.Handshake(
                pb.HandshakeRequest(
                    engine_id=self.engine_id,
                    layout=layout_to_pb(self.layout),
                    ucx_address=self.transport.address,
                ),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            channel.close()
            raise TransferFailed(f"prefill worker {address} unreachable: {rpc_error(e)}") from e
        diff = self.layout.difference(layout_from_pb(reply.layout))  # said from our side
        peer_layout = layout_from_pb(reply.layout)
        remote = onesided.RemoteMemory.from_pb(reply) if self.one_sided else None
        try:
            if diff or not reply.ok:
                raise TransferFailed(diff or reply.error)
            plan = self._plan_with(peer_layout, address, remote)
        except TransferFailed as e:
            channel.close()
            raise TransferFailed(f"prefill worker {address} refused the handshake: {e}") from None
        peer = Peer(
            channel,
            stub,
            reply.ucx_address,
            reply.engine_id,
            reply.scatter_gather,
            peer_layout,
            plan,
            remote,
        )
        with self._lock:
            kept = self._peers.setdefault(address, peer)
        if kept is not peer:  # another thread dialed it meanwhile
            channel.close()
        return kept

    def peer_layout(self, address: str) -> KVLayout:
        """The layout of the prefill worker at `address` (handshaking once). Raises
        TransferFailed as `dial`."""
        return self._peer(address).layout

    def dial(self, address: str) -> None:
        """Handshake with a known prefill worker now, before any request needs it (the
        first pull from a peer otherwise pays the channel's and the handshake's set-up;
        the prefill worker makes its UCX endpoint to us then too). Raises TransferFailed
        when the peer cannot be reached or its layout differs."""
        self._peer(address)

    def _plan_with(self, peer_layout: KVLayout, address: str = "", remote=None):
        """Our plan for pulls from a peer of `peer_layout`: pages of one pool each side, or
        pieces between tensor-parallel groups (`connector.tp_plan.ShardedPlan`), or this
        rank's pieces at a peer rank of another size (`rank_plans`: read one-sided)."""
        if self.layout.tp_size == 1 and peer_layout.tp_size == 1:
            return self._plan
        if self._rank_plans is not None and peer_layout.tp_size != self.layout.tp_size:
            if remote is None:
                raise TransferFailed(
                    f"tensor-parallel size {peer_layout.tp_size} there and "
                    f"{self.layout.tp_size} here: each rank reads its pieces one-sided, "
                    f"which needs {onesided.ENV}=1 on both servers"
                )
            return self._rank_plans(peer_layout, address)
        if self._shard_buffers is None and peer_layout.tp_size == self.layout.tp_size:
            return self._plan  # rank paired with rank (vLLM's workers: each moves its own)
        if self._shard_buffers is None:
            raise TransferFailed("a tensor-parallel peer needs this worker's pools in rank order")
        return ShardedPlan(peer_layout, self.layout, self._shard_buffers)

    def _stub(self, address: str) -> pb_grpc.KVControlStub:
        """A control stub for calls that move no KV (Abort), made without a handshake: a
        peer whose layout differs may still be told to drop what it keeps for us."""
        with self._lock:
            peer = self._peers.get(address)
            if peer is not None:
                return peer.stub
            if not self.admission.may_dial(address):
                raise TransferFailed(f"{address} is not a known prefill worker of this one")
            if address not in self._bare:
                self._bare[address] = grpc.insecure_channel(address)
            return pb_grpc.KVControlStub(self._bare[address])

    def forget_peer(self, address: str) -> None:
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            peer.channel.close()
