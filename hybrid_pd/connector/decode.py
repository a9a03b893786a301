"""Decode side: pull a handed-over request's KV into blocks the scheduler reserved.

The engine's scheduler allocates the blocks in turn and calls `start_load_kv`; the pull runs
on this connector's own threads and its end is reported through `get_finished` between steps
(the connector's worker side, after vLLM's KVConnectorBase_V1):

handshake (once per prefill worker: layouts must match)
one-sided (the prefill worker offers its memory, `onesided`): read the runs straight into
    the destination runs → PullKV(read_done): the prefill worker confirms → Release
two-sided (`decode_recv`): post UCX receives straight into the destination runs →
    PullKV (prefill sends the runs) → wait for the receives → Release

Staged params (the proxy sent them while the prefill still runs): `decode_stage.StagedLoads`
follows the prefill, a state advanced by Progress replies, pulling final attention blocks as
they come; its final pull is `pull` with the staged blocks held.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.connector import onesided, timeline
from hybrid_pd.connector.admission import Admission
from hybrid_pd.connector.base import LoadResult, TransferFailed
from hybrid_pd.connector.control import call_metadata, layout_to_pb
from hybrid_pd.connector.decode_peer import Peer, PeerBook, Refused, TransferStats, rpc_error
from hybrid_pd.connector.decode_recv import TwoSidedPulls
from hybrid_pd.connector.decode_stage import StagedLoads
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.segments import (
    MESSAGE_MAX_BYTES,
    MESSAGE_MAX_REGIONS,
    PagedPlan,
    TransferPlan,
)
from hybrid_pd.connector.tp_plan import ShardedPlan
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID, EngineId, RequestId
from hybrid_pd.proto import kv_control_pb2 as pb

__all__ = ["DecodeConnector", "TransferStats"]

logger = logging.getLogger(__name__)


class DecodeConnector(TwoSidedPulls, PeerBook):
    def __init__(
        self,
        *,
        engine_id: EngineId,
        layout: KVLayout,
        transport,
        region: Callable[[int, int], object] | None = None,
        plan: TransferPlan | None = None,
        secret: str | None = None,
        timeout_s: float = 30.0,
        max_parallel_pulls: int = 8,
        peers: tuple[str, ...] = (),
        scatter_gather: bool = True,
        message_max_bytes: int = MESSAGE_MAX_BYTES,
        message_max_regions: int = MESSAGE_MAX_REGIONS,
        max_staged_loads: int = 64,
        shard_buffers: Callable[[], Sequence] | None = None,
        one_sided: bool | None = None,
        rank_plans: Callable[[KVLayout, str], object] | None = None,
    ) -> None:
        """`peers`: control addresses of the prefill workers this worker may dial (more
        come through `add_peers`); kv_transfer_params naming any other address fail unless
        they are signed with `secret` (`connector.admission`).
        `region(first_block, n)` or `plan`: as for PrefillConnector. `scatter_gather`:
        pack a transfer's regions (runs of blocks) into few UCX messages, each at most
        `message_max_regions` regions and `message_max_bytes` bytes (CPU pools, and peers
        that take it); off: one message per region. `shard_buffers()`: this worker's
        ranks' pools, rank order (a tensor-parallel worker, or any worker pulling from
        one: `connector.tp_plan`). `max_staged_loads`: staged loads followed at once (more
        wait their turn; none holds a thread while its prefill runs). `one_sided`: read
        from peers that offer their memory (`connector.onesided`; default: unless
        HYBRID_PD_UCX_ONESIDED=0). `rank_plans(peer_layout, address)`: where this
        worker is one rank that reads its own pieces (vLLM's ranks), the plan for a peer
        rank of another TP size at `address` (read one-sided only; raises TransferFailed
        when the pair cannot be mapped)."""
        if (region is None) == (plan is None):
            raise ValueError("give exactly one of region and plan")
        self.engine_id = engine_id
        self.layout = layout
        self.transport = transport
        self.one_sided = onesided.enabled() if one_sided is None else one_sided
        self._plan = plan if plan is not None else PagedPlan(region, layout.page_size_bytes)
        self._shard_buffers = shard_buffers
        self._rank_plans = rank_plans
        self._metadata = call_metadata(secret)
        self.timeout_s = timeout_s
        self._peers: dict[str, Peer] = {}
        self._bare: dict[str, grpc.Channel] = {}  # control-only channels (see _stub)
        #: Which prefill workers this one may dial (known peers, signed params' addresses).
        self.admission = Admission(peers, secret)
        self._lock = threading.Lock()
        # Tags: a random per-connector base plus a counter, 2**16 messages per transfer.
        self._tag_base = secrets.randbits(24) << 40
        self.scatter_gather = scatter_gather
        self.message_max_bytes = message_max_bytes
        self.message_max_regions = message_max_regions
        self._counter = itertools.count()
        self.stats: dict = {
            "pulls": 0,
            "failed": 0,
            "held_blocks": 0,  # blocks not pulled: this worker's prefix cache held them
            "staged_loads": 0,  # loads that began while the prefill ran
            "staged_pulls": 0,
            "staged_bytes": 0,
            "staged_void": 0,  # staged pulls refused or voided (pulled again later)
            "bytes": 0,
            "messages": 0,
            "seconds": 0.0,  # pull time of the successful pulls, handshake to arrival
            "last_error": "",
            # bytes each of this worker's ranks received (tensor-parallel pulls; a single
            # rank otherwise: its total is "bytes")
            "bytes_by_rank": [0] * layout.tp_size,
        }
        #: Called (from a pull thread) when a load ended: the engine loop's `wake`.
        self.notify: Callable[[], None] = lambda: None
        self._pulls = ThreadPoolExecutor(max_parallel_pulls, thread_name_prefix="kv-pull")
        self._control = ThreadPoolExecutor(1, thread_name_prefix="kv-control")
        # Staged loads hold no thread while their prefill runs: each Progress reply
        # advances one on a pull thread (`decode_stage`); at most max_staged_loads at once.
        self._staged = StagedLoads(self, max_staged_loads)
        self._finished: list[LoadResult] = []

    def _count(self, **deltas: float) -> None:
        """Add to the counters together: pull threads run side by side, and a reader
        (`stats_snapshot`) must never see a pull counted without its bytes."""
        with self._lock:
            for k, v in deltas.items():
                self.stats[k] += v

    def _count_ranks(self, plan, runs) -> None:
        if isinstance(plan, ShardedPlan):
            by_rank = plan.bytes_by_rank(runs, "dst")
        else:
            by_rank = [plan.nbytes(runs)]
        with self._lock:
            counts = self.stats["bytes_by_rank"]
            for rank, n in enumerate(by_rank):
                counts[rank] += n

    def stats_snapshot(self) -> dict:
        """A consistent copy of `stats`."""
        with self._lock:
            return {**self.stats, "bytes_by_rank": list(self.stats["bytes_by_rank"])}

    # -- worker side (ConnectorWorker) ------------------------------------------------------
    def start_load_kv(
        self,
        request_id: RequestId,
        params: KVTransferParams,
        block_ids: tuple[list[int], ...],
        held: Sequence[int] = (),
        sources: Callable[[KVTransferParams], tuple[list, list]] | None = None,
    ) -> None:
        """`sources(params)`: where the KV lies in pieces at several prefill ranks (vLLM's
        ranks across TP sizes), (the params addressed to each rank to pull from, those of
        ranks only to release: they keep blocks no decode rank reads), called on the pull
        thread (it may handshake); the load pulls from each in turn and releases all."""
        if params.staged:
            self._staged.start(request_id, params, block_ids, tuple(held))
            return
        self._pulls.submit(self._load, request_id, params, block_ids, tuple(held), sources)

    def _load(self, request_id: RequestId, params, block_ids, held, sources=None) -> None:
        timeline.stamp(params.request_id, "pull_start")
        release, todo, unread = None, [params], []
        try:
            t0, nbytes, messages = time.perf_counter(), 0, 0
            if sources is not None:
                todo, unread = sources(params)
            for p in todo:
                st = self.pull(p, block_ids, release=False, held=held, spend=False)
                nbytes, messages = nbytes + st.bytes, messages + st.messages
            self.admission.spend(params)
            release = [*todo, *unread]
            res = LoadResult(request_id, None, nbytes, messages, time.perf_counter() - t0)
        except TransferFailed as e:
            res = LoadResult(request_id, str(e))
        except Exception as e:  # never lose a load: the engine must hear that it ended
            logger.exception("KV pull for %s failed", request_id)
            res = LoadResult(request_id, f"{type(e).__name__}: {e}")
        if res.error is not None:
            logger.warning("KV pull for %s failed: %s", request_id, res.error)
            for p in [*todo, *unread]:
                if self.admission.may_dial(p.control_address):
                    self.abort_later(p)  # the prefill worker frees it now, not at expiry
        timeline.stamp(params.request_id, "finish_load")
        self.finish_load(res)
        for p in release or ():  # after the engine heard: not on the request's critical path
            self.release_after(p)

    def finish_load(self, res: LoadResult) -> None:
        """A load ended: the engine hears it (`get_finished`) and is woken (`notify`)."""
        with self._lock:
            if res.error is not None:
                self.stats["last_error"] = res.error
            self._finished.append(res)
        self.notify()

    def release_after(self, params: KVTransferParams) -> None:
        """Release a pulled request's KV on its prefill worker (best effort: else its
        lease expires on its own)."""
        try:
            self._release(self._peer(params.control_address), params)
        except TransferFailed as e:
            logger.warning("release of %s failed (%s)", params.request_id, e)

    def get_finished(self) -> list[LoadResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def has_finished(self) -> bool:
        return bool(self._finished)

    def keep_alive(self, params: Sequence[KVTransferParams]) -> None:
        if params:
            self._control.submit(self.heartbeat, list(params))

    def abort_later(self, params: KVTransferParams) -> None:
        """`abort` on the control thread (the request was dropped before its pull). A
        staged load still following its prefill ends (`StagedLoads.drop`)."""
        if params.staged:
            self._staged.drop(params.request_id)
            return
        try:
            self._control.submit(self.abort, params)
        except RuntimeError:  # closed: the lease expires on its own
            logger.warning("abort of %s not sent: the connector closed", params.request_id)

    def pull(
        self,
        params: KVTransferParams,
        dst_block_ids: tuple[list[int], ...],
        release: bool = True,
        held: Sequence[int] = (),
        staged: int = 0,
        spend: bool = True,
    ) -> TransferStats:
        """Fill `dst_block_ids` (this worker's blocks, per group, null blocks included) with
        the request's KV; then (`release`) release it on the prefill worker. `held[g]`:
        group g's first non-null blocks already hold their KV and are skipped (the prefill
        worker sends only the rest; `staged` of them were staged pulls, not this worker's
        prefix cache). Raises TransferFailed. The seconds reported run from the call to
        the bytes' arrival. `spend`: the params are spent here (else the caller spends
        them once its other pulls of the same request succeeded)."""
        t0 = time.perf_counter()
        self.admission.admit(params)  # a known peer, or signed params; never a replay
        peer = self._peer(params.control_address)  # the handshake names a layout mismatch
        timeline.stamp(params.request_id, "peer_ready")
        # the params must come from the layout the handshake agreed to (ours, or a
        # tensor-parallel peer's that maps onto ours)
        if params.fingerprint != (peer.layout or self.layout).fingerprint:
            raise TransferFailed(
                "KV layout fingerprint in kv_transfer_params differs from the prefill worker's"
            )
        skip = list(held) if any(held) else []
        if skip and len(skip) != len(dst_block_ids):
            raise ValueError(f"held has {len(skip)} groups, block ids {len(dst_block_ids)}")
        dst = [[b for b in g if b != NULL_BLOCK_ID] for g in dst_block_ids]
        src = params.block_ids
        if skip:
            dst = [g[n:] for g, n in zip(dst, skip, strict=True)]
            src = tuple(list(g[n:]) for g, n in zip(src, skip, strict=False))
        try:
            reply = self._transfer(peer, params, src, dst, "the pull", skip_blocks=skip)
        except Refused as e:
            self._count(failed=1)
            raise TransferFailed(f"prefill worker refused the pull: {e}") from None
        except Exception:
            self._count(failed=1)
            raise
        stats = TransferStats(reply.bytes, reply.messages, time.perf_counter() - t0)
        if spend:
            self.admission.spend(params)
        if release:
            self._release(peer, params)
        self._count(
            pulls=1,
            held_blocks=sum(skip) - staged,
            bytes=stats.bytes,
            messages=stats.messages,
            seconds=stats.seconds,
        )
        return stats

    def _transfer(self, peer: Peer, params: KVTransferParams, src, dst, what: str, **fields):
        """Move `src`'s runs into `dst`'s: read them one-sided and confirm (a peer that
        offers its memory, `onesided`), or post receives and ask the prefill worker to
        send (PullKV with `fields`). Its reply once the bytes have arrived. Raises Refused
        when the prefill worker refused, TransferFailed when the transfer failed."""
        plan = peer.plan or self._plan
        try:
            runs = plan.runs(src, dst)
        except ValueError as e:
            raise TransferFailed(f"{what} does not fit this request: {e}") from e

        def request(**more) -> pb.PullRequest:
            return pb.PullRequest(
                request_id=params.request_id,
                transfer_token=params.transfer_token,
                engine_id=self.engine_id,
                ucx_address=self.transport.address,
                dst_blocks=[pb.BlockIds(ids=g) for g in dst],
                dst_layout=layout_to_pb(self.layout) if peer.plan is not self._plan else None,
                **getattr(plan, "pull_fields", {}),
                **fields,
                **more,
            )

        if peer.remote is not None and onesided.readable(plan):
            reply, reads = onesided.read_pull(self, peer, params, plan, runs, what, request)
            if not reply.ok:
                raise Refused(reply.error)
            reply.messages = reads
        else:
            reply = self._receive(peer, params, plan, runs, what, request)
        self._count_ranks(plan, runs)
        return reply

    def _release(self, peer: Peer, params: KVTransferParams) -> None:
        try:
            reply = peer.stub.Release(
                pb.ReleaseRequest(
                    request_id=params.request_id, transfer_token=params.transfer_token
                ),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
            if not reply.ok:
                logger.warning("release of %s: %s", params.request_id, reply.error)
        except grpc.RpcError as e:  # the lease expires on its own
            logger.warning(
                "release of %s failed (%s); its lease will expire", params.request_id, rpc_error(e)
            )

    def abort(self, params: KVTransferParams) -> None:
        """Tell the prefill worker to drop the request's KV now (best effort)."""
        try:
            self._stub(params.control_address).Abort(
                pb.AbortRequest(request_id=params.request_id, transfer_token=params.transfer_token),
                timeout=self.timeout_s,
                metadata=self._metadata,
            )
        except (grpc.RpcError, TransferFailed) as e:
            logger.warning("abort of %s not delivered: %s", params.request_id, e)

    def heartbeat(self, params: list[KVTransferParams]) -> list[str]:
        """Extend the leases of requests still to be pulled; returns ids the prefill workers
        no longer keep."""
        lost: list[str] = []
        by_peer: dict[str, list[KVTransferParams]] = {}
        for p in params:
            by_peer.setdefault(p.control_address, []).append(p)
        for address, group in by_peer.items():
            try:
                reply = self._peer(address).stub.Heartbeat(
                    pb.HeartbeatRequest(
                        engine_id=self.engine_id,
                        request_ids=[p.request_id for p in group],
                        transfer_tokens=[p.transfer_token for p in group],
                    ),
                    timeout=self.timeout_s,
                    metadata=self._metadata,
                )
                lost += list(reply.unknown_request_ids)
            except (grpc.RpcError, TransferFailed):
                lost += [p.request_id for p in group]
        return lost

    def close(self) -> None:
        self._staged.close()  # staged loads end now (their Progress calls are cancelled)
        self._pulls.shutdown(wait=True, cancel_futures=True)
        self._control.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            channels = [p.channel for p in self._peers.values()] + list(self._bare.values())
            self._peers.clear()
            self._bare.clear()
        for channel in channels:
            channel.close()
