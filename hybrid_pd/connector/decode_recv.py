"""Decode side, two-sided pulls: post receives into the destination runs, ask the prefill
worker to send them (PullKV), wait for the bytes (the path when the peer offers no memory to
read one-sided, or with HYBRID_PD_UCX_ONESIDED=0)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.connector import timeline
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.decode_peer import Peer, Refused, rpc_error
from hybrid_pd.connector.segments import (
    PagedPlan,
    group_regions,
    pack_messages,
    split_iov,
)
from hybrid_pd.connector.tp_plan import ShardedPlan


class TwoSidedPulls:
    """The two-sided half of `DecodeConnector` (a mixin: it uses the connector's
    transport, plan, tags, packing limits, timeout and call metadata)."""

    def _receive(self, peer: Peer, params: KVTransferParams, plan, runs, what: str, request):
        """The two-sided pull: receives posted, PullKV, the bytes awaited."""
        try:
            messages, packing = self._messages(peer, runs)
        except ValueError as e:
            raise TransferFailed(f"{what} does not fit this request: {e}") from e
        if len(messages) >= 1 << 16:
            raise TransferFailed("transfer too fragmented (over 65536 messages)")
        tag = self._tag_base | (next(self._counter) % (1 << 24)) << 16
        handle = self.transport.post_recv(peer.ucx_address, tag, messages)
        timeline.stamp(params.request_id, "recvs_posted", messages=len(messages))
        try:
            reply = peer.stub.PullKV(
                request(tag=tag, message_regions=packing),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
            if not reply.ok:
                raise Refused(reply.error)
            timeline.stamp(params.request_id, "pull_replied")
            handle.wait(self.timeout_s)
            timeline.stamp(params.request_id, "bytes_arrived")
        except grpc.RpcError as e:
            handle.cancel()
            self.forget_peer(params.control_address)
            raise TransferFailed(
                f"prefill worker {params.control_address} failed during {what}: {rpc_error(e)}"
            ) from e
        except BaseException:
            handle.cancel()
            raise
        return reply

    def _messages(self, peer: Peer, runs: Sequence) -> tuple[list, list[int]]:
        """(the transport's messages to receive into, the packing the prefill side is told:
        regions per message, or [] for one message per region)."""
        packs = self.scatter_gather and peer.scatter_gather
        plan = peer.plan or self._plan
        if packs and isinstance(plan, (PagedPlan, ShardedPlan)) and len(runs):
            found = plan.iov(runs, "dst")  # pools: rows, not a tensor per run
            if found is not None:
                iov, pool = found
                packing = self._pack(iov[:, 1].tolist())
                return split_iov(iov, pool, packing), packing
        regions = plan.dst_regions(runs)
        if not packs or len(regions) < 2 or any(r.device.type != "cpu" for r in regions):
            return regions, []  # scatter-gather between GPUs is not checked yet
        packing = self._pack([r.numel() * r.element_size() for r in regions])
        return group_regions(regions, packing), packing

    def _pack(self, sizes: list[int]) -> list[int]:
        return pack_messages(sizes, self.message_max_bytes, self.message_max_regions)
