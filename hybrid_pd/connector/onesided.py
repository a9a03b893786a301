"""One-sided pulls: decode reads a request's KV from the prefill worker's memory itself.

The prefill worker maps every region a transfer may read (its pool, its ranks' pools, or
vLLM's per-layer caches: `plan.memory()`) once, at its first handshake, and sends their
addresses and packed UCX remote keys in the HandshakeReply (`remote_memory`). A decode
worker then pulls a request by

    plan the runs (as for a two-sided pull) ─► read each piece (ucp_get_nbx, no thread of
    the prefill worker involved) ─► PullKV(read_done) ─► the prefill worker confirms that
    the blocks were kept (staged: under the same epoch) all along, and counts them

so the control plane keeps its leases, tokens, secret and signed params: the bytes read
count only when that confirmation says ok. A lease alive at the confirmation was alive
for the whole read (a lease never comes back), and a kept block is never written, so the
bytes read are the kept KV. A refusal voids them (the decode side recomputes, or pulls a
staged block again).

On one host (the owner's boot id is ours and its process is visible) decode reads with
`process_vm_readv` itself (`ucx.cma`): a prefill worker that dies mid-read fails that pull
only. UCX's own CMA read would abort the reading process instead. Elsewhere it reads with
UCX (`ucp_get_nbx`, over TCP or RDMA).

It is the default; HYBRID_PD_UCX_ONESIDED=0 in either process turns it off (a prefill
worker without it offers no memory, a decode worker without it uses none), and
HYBRID_PD_UCX_ONESIDED=ucx reads with UCX on one host too (what a second host gets).
Pulls are two-sided with a peer whose pools cannot be mapped (GPU pools for now), whose
plan has no `read_pieces`, or whose memory this process may not read.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from hybrid_pd.connector import faults, liveness, timeline
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.decode_peer import rpc_error
from hybrid_pd.connector.ucx import TransferError, cma
from hybrid_pd.connector.ucx.rma import KEY, LOCAL, NBYTES, REMOTE
from hybrid_pd.proto import kv_control_pb2 as pb

logger = logging.getLogger(__name__)

ENV = "HYBRID_PD_UCX_ONESIDED"


def mode() -> str:
    """How this process pulls and offers its memory: "on" (the default: one-sided, read by
    this process itself on one host), "ucx" (one-sided, always through UCX), or "off"
    (two-sided), from HYBRID_PD_UCX_ONESIDED."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value == "ucx":
        return "ucx"
    return "off" if value in ("0", "false", "no", "off") else "on"


def enabled() -> bool:
    """Whether this process pulls (and offers its memory) one-sided (`mode`)."""
    return mode() != "off"


class Exposure:
    """The prefill side's memory as peers may read it, mapped once (thread-safe, lazy:
    the engine makes its pool after the connector exists)."""

    def __init__(
        self,
        transport,
        regions: Callable[[], list[tuple[int, int]] | None],
        on: bool | None = None,
    ) -> None:
        """`on`: offer the memory (default: unless HYBRID_PD_UCX_ONESIDED=0)."""
        self._on = enabled() if on is None else on
        self._transport = transport
        self._regions = regions
        self._lock = threading.Lock()
        self._done = False
        self._msg: pb.RemoteMemory | None = None

    def describe(self) -> pb.RemoteMemory | None:
        """The HandshakeReply's remote_memory; None when this worker offers none (turned
        off, or memory UCX cannot map)."""
        with self._lock:
            if not self._done:
                self._done = True
                if self._on and self._transport is not None:
                    try:
                        self._msg = _expose(self._transport, self._regions())
                    except Exception as e:
                        logger.warning("one-sided reads off (pulls are sent instead): %s", e)
            return self._msg


def _expose(transport, regions: list[tuple[int, int]] | None) -> pb.RemoteMemory | None:
    """Map `regions` ((address, bytes) each), merged where they touch or overlap, once."""
    if not regions or not hasattr(transport, "map_memory"):
        return None
    spans: list[list[int]] = []
    for a, n in sorted(regions):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], a + n)
        else:
            spans.append([a, a + n])
    mapped = [transport.map_memory(a, b - a) for a, b in spans]
    pid = os.getpid()
    msg = pb.RemoteMemory(
        rkeys=[m.rkey for m in mapped],
        pid=pid,
        start_ticks=liveness.start_ticks(pid),
        boot_id=liveness.boot_id(),
    )
    for a, n in regions:
        key = next(i for i, (s, e) in enumerate(spans) if s <= a and a + n <= e)
        msg.regions.add(address=a, bytes=n, key=key)
    return msg


@dataclass(frozen=True)
class RemoteMemory:
    """A peer's readable memory as a decode worker holds it (from its HandshakeReply)."""

    address: np.ndarray  # uint64, per region
    nbytes: np.ndarray  # int64, per region
    key: np.ndarray  # int64, per region: index into rkeys
    rkeys: tuple[bytes, ...]
    #: The owner, where it runs on this host; None: elsewhere.
    owner: liveness.ProcessWatch | None = None
    #: The owner's pid when this process reads it itself (`ucx.cma`); 0: UCX reads.
    pid: int = 0

    @classmethod
    def from_pb(cls, reply: pb.HandshakeReply) -> RemoteMemory | None:
        """What `reply` offers; None when it offers nothing, or its owner runs on this
        host but cannot be watched (never read blindly there)."""
        if not reply.HasField("remote_memory"):
            return None
        m = reply.remote_memory
        if not m.regions or any(r.key >= len(m.rkeys) for r in m.regions):
            return None
        owner, pid = None, 0
        if m.boot_id and m.boot_id == liveness.boot_id():
            owner = liveness.watch(m.pid, m.start_ticks)
            if owner is None:
                logger.warning("one-sided reads off for a peer whose process is not visible")
                return None
            if mode() != "ucx":
                if not cma.can_read(m.pid, m.regions[0].address):
                    logger.warning(
                        "one-sided reads off for a peer whose memory this process may not "
                        "read (process_vm_readv refused)"
                    )
                    return None
                pid = m.pid
        return cls(
            np.array([r.address for r in m.regions], dtype=np.uint64),
            np.array([r.bytes for r in m.regions], dtype=np.int64),
            np.array([r.key for r in m.regions], dtype=np.int64),
            tuple(m.rkeys),
            owner,
            pid,
        )

    def alive(self) -> bool:
        """False once the owner (on this host) has exited: it must not be read."""
        return self.owner is None or self.owner.alive()

    def rows(self, pieces: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The transport's read rows for `pieces` (region, offset, bytes) read into
        `local` addresses; ValueError for a piece outside its region."""
        region, off, n = pieces[:, 0], pieces[:, 1], pieces[:, 2]
        if len(pieces) and (
            (region < 0).any()
            or (region >= len(self.nbytes)).any()
            or (off < 0).any()
            or (off + n > self.nbytes[np.clip(region, 0, len(self.nbytes) - 1)]).any()
        ):
            raise ValueError("a piece lies outside the prefill worker's mapped memory")
        rows = np.empty((len(pieces), 4), dtype=np.uint64)
        rows[:, LOCAL] = local
        rows[:, REMOTE] = self.address[region] + off.astype(np.uint64)
        rows[:, NBYTES] = n.astype(np.uint64)
        rows[:, KEY] = self.key[region].astype(np.uint64)
        return rows


def readable(plan) -> bool:
    """Whether a decode worker's plan can turn runs into one-sided reads."""
    return hasattr(plan, "read_pieces")


def read_pull(
    conn, peer, params, plan, runs, what: str, request: Callable[..., pb.PullRequest]
) -> tuple[pb.PullReply, int]:
    """One pull of `runs` by a DecodeConnector `conn`, one-sided: read the pieces from
    `peer` into this worker's blocks, then confirm with PullKV(read_done) (built by
    `request(read_done=True)`). Returns (the reply, reads posted); raises TransferFailed
    when the read or the call failed. A reply that is not ok voids the bytes read."""
    rid = params.request_id
    try:
        pieces, local, keep = plan.read_pieces(runs)
        rows = peer.remote.rows(pieces, local)
    except ValueError as e:
        raise TransferFailed(f"{what} does not fit this request: {e}") from e
    if not peer.remote.alive():
        conn.forget_peer(params.control_address)
        raise TransferFailed(
            f"prefill worker {params.control_address} is gone (its process exited)"
        )
    timeline.stamp(rid, "reads_posted", reads=len(rows))
    if len(rows):
        try:
            if peer.remote.pid:
                conn.transport.read_local(peer.remote.pid, rows)
                if not peer.remote.alive():  # its pid may have named another process
                    raise TransferError("the prefill process exited during the read")
            else:
                rkeys = list(peer.remote.rkeys)
                conn.transport.read(peer.ucx_address, rkeys, rows, keep, conn.timeout_s)
        except TransferError as e:
            conn.forget_peer(params.control_address)
            raise TransferFailed(
                f"prefill worker {params.control_address} failed during {what} "
                f"(one-sided read): {e}"
            ) from e
    if faults.zeroed(rid):  # the negative control: what arrived is zeros
        for local_address, n in rows[:, [LOCAL, NBYTES]].tolist():
            ctypes.memset(local_address, 0, n)
    timeline.stamp(rid, "reads_done")
    try:
        reply = peer.stub.PullKV(
            request(read_done=True), timeout=conn.timeout_s, metadata=conn._metadata
        )
    except grpc.RpcError as e:
        conn.forget_peer(params.control_address)
        raise TransferFailed(
            f"prefill worker {params.control_address} failed during {what}: {rpc_error(e)}"
        ) from e
    timeline.stamp(rid, "pull_replied")
    timeline.stamp(rid, "bytes_arrived")  # confirmed: the bytes read are the KV
    nbytes = int(rows[:, NBYTES].sum()) if len(rows) else 0
    if reply.ok and reply.bytes != nbytes:
        raise TransferFailed(f"read {nbytes} bytes, the prefill worker counts {reply.bytes}")
    return reply, len(rows)


def prefill_regions(
    plan, shard_buffers: Callable[[], Sequence] | None, tp_size: int
) -> list[tuple[int, int]] | None:
    """The prefill side's readable regions in the order decode's plans number them: the
    ranks' pools (a tensor-parallel worker), else the plan's."""
    if shard_buffers is not None and tp_size > 1:
        pools = list(shard_buffers())
        if any(p.device.type != "cpu" or not p.is_contiguous() for p in pools):
            return None
        return [(p.data_ptr(), p.numel() * p.element_size()) for p in pools]
    memory = getattr(plan, "memory", None)
    return memory() if memory is not None else None
