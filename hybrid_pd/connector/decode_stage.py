"""Decode side, staged: a load that begins while its prefill still runs (the overlap of the
KV hand-over with the prefill).

A staged load is a state, not a thread. Each Progress reply (a long-poll the prefill worker
answers when its engine published progress, it kept the KV or it ended) advances the load
by one step on one of the connector's pull threads, which then asks again and returns:

    begin ─► ask Progress(min tokens) ··· reply ─► advance ─┬─► ask again
                                                            ├─► staged pull, ask again
                                                            └─► kept: final pull ─► end

Each time attention blocks are final there (all their tokens computed, and still read at the
end of the prompt), pull them (a staged PullKV); once the prefill kept its KV, the final pull
sends only the rest (state pages, the last blocks). Blocks staged under an epoch the prefill
left (preempted there) are pulled again. Between replies a load holds no thread; dropping it
cancels its Progress call, which ends it at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.connector.base import LoadResult, TransferFailed
from hybrid_pd.connector.decode_peer import Peer, Refused, TransferStats, rpc_error
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID, EngineId, RequestId
from hybrid_pd.proto import kv_control_pb2 as pb

if TYPE_CHECKING:
    from hybrid_pd.connector.decode import DecodeConnector

logger = logging.getLogger(__name__)

#: How long one Progress call may wait, how many whole blocks a staged pull waits for (fewer
#: only in the final pull), and how many refused staged pulls in a row end the staging (the
#: final pull then sends everything).
PROGRESS_WAIT_S = 5.0
STAGE_MIN_BLOCKS = 1
STAGE_MAX_VOID = 3

_DROPPED = "the request was dropped while its prefill ran"


@dataclass
class StagedLoad:
    """One staged load: where it stands between two Progress replies."""

    request_id: RequestId  # this engine's
    params: KVTransferParams  # as the proxy sent them (the prefill's request id, token)
    block_ids: tuple[list[int], ...]
    held: tuple[int, ...]
    #: Per group: this worker's non-null destination blocks, and how many null blocks lead
    #: them (the positions the end of the prompt no longer reads).
    dst: list[list[int]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    base: list[int] = field(default_factory=list)  # blocks held before staging
    have: list[int] = field(default_factory=list)  # blocks holding their KV now
    epoch: int = 0
    void: int = 0  # staged pulls refused
    moved: list[int] = field(default_factory=lambda: [0, 0])  # bytes, messages that stood
    want: int = 0  # min_tokens of the Progress call in flight
    admitted_by: float = 0.0
    peer: Peer | None = None
    call: grpc.Future | None = None
    dropped: bool = False

    def __post_init__(self) -> None:
        self.dst = [[b for b in g if b != NULL_BLOCK_ID] for g in self.block_ids]
        self.skipped = [len(g) - len(d) for g, d in zip(self.block_ids, self.dst, strict=True)]
        self.base = list(self.held) if self.held else [0] * len(self.dst)
        self.have = list(self.base)


class StagedLoads:
    """The staged loads of one `DecodeConnector`: at most `max_loads` followed at once (more
    wait their turn), each advanced by its Progress replies on the connector's pull threads.
    Every load ends in exactly one `LoadResult` (`DecodeConnector.finish_load`) while the
    connector is open; closing it drops what is queued or in flight unreported."""

    def __init__(self, conn: DecodeConnector, max_loads: int) -> None:
        self._conn = conn
        self._max = max(1, max_loads)
        self._lock = threading.Lock()
        self._loads: dict[str, StagedLoad] = {}  # by the prefill's request id
        self._queue: deque[StagedLoad] = deque()
        self._active = 0
        self._closing = False

    def start(self, request_id: RequestId, params: KVTransferParams, block_ids, held) -> None:
        load = StagedLoad(request_id, params, block_ids, tuple(held))
        with self._lock:
            self._loads[params.request_id] = load
            if self._active >= self._max:
                self._queue.append(load)
                return
            self._active += 1
        self._submit(self._begin, load)

    def drop(self, prefill_request_id: RequestId) -> None:
        """The request was dropped: its load ends (with an error) at once if it waits for
        a Progress reply, else at its next step."""
        with self._lock:
            load = self._loads.get(prefill_request_id)
            if load is None:
                return
            load.dropped = True
            call = load.call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """Loads in flight end at once (their calls are cancelled); queued ones never run."""
        with self._lock:
            self._closing = True
            self._queue.clear()
            calls = [ld.call for ld in self._loads.values() if ld.call is not None]
        for call in calls:
            call.cancel()

    # -- steps (each on a pull thread) --------------------------------------------------------
    def _submit(self, step: Callable[[StagedLoad], None], load: StagedLoad) -> None:
        try:
            self._conn._pulls.submit(step, load)
        except RuntimeError:  # the connector closed: the load ends here
            self._end(load, TransferFailed(_DROPPED))

    def _begin(self, load: StagedLoad) -> None:
        try:
            self._conn._count(staged_loads=1)
            load.admitted_by = time.monotonic() + self._conn.timeout_s
            load.peer = self._conn._peer(load.params.control_address)
            self._ask(load)
        except Exception as e:
            self._end(load, e)

    def _ask(self, load: StagedLoad) -> None:
        """Send the next Progress call; its reply schedules `_on_reply`."""
        self._check_dropped(load)
        params, bs = load.params, self._conn.layout.block_size
        stageable = [g.kind != "state" for g in self._conn.layout.groups]
        # Where the next block to stage is complete; none left (or staging gave up): wait
        # for the end, which Progress answers at once (min_tokens past the prompt).
        ends = [
            (load.skipped[g] + load.have[g] + STAGE_MIN_BLOCKS) * bs
            for g in range(len(load.dst))
            if stageable[g] and load.have[g] < len(load.dst[g])
        ]
        ends = [t for t in ends if t <= params.prompt_len]
        ok = ends and load.void < STAGE_MAX_VOID
        load.want = min(ends) if ok else params.prompt_len + 1
        call = load.peer.stub.Progress.future(
            pb.ProgressRequest(
                request_id=params.request_id,
                transfer_token=params.transfer_token,
                min_tokens=load.want,
                wait_s=PROGRESS_WAIT_S,
            ),
            timeout=PROGRESS_WAIT_S + self._conn.timeout_s,
            metadata=self._conn._metadata,
        )
        with self._lock:
            load.call = call
            dropped = load.dropped or self._closing
        if dropped:
            call.cancel()
        call.add_done_callback(lambda _: self._submit(self._on_reply, load))

    def _on_reply(self, load: StagedLoad) -> None:
        final = None
        try:
            final = self._advance(load, self._reply(load))
            if final is None:
                self._ask(load)
                return
            res = self._final_pull(load, final)
        except Exception as e:
            self._end(load, e, final)
            return
        self._end(load, None, final, res)

    def _check_dropped(self, load: StagedLoad) -> None:
        with self._lock:
            if load.dropped or self._closing:
                raise TransferFailed(_DROPPED)

    def _reply(self, load: StagedLoad):
        """The Progress reply (a call cancelled by `drop` or `close`: the load ends); as
        before each look, a drop that came after the reply is seen at the next ask."""
        address = load.params.control_address
        try:
            reply = load.call.result()
        except grpc.FutureCancelledError:
            raise TransferFailed(_DROPPED) from None
        except grpc.RpcError as e:
            self._conn.forget_peer(address)
            raise TransferFailed(
                f"prefill worker {address} failed during the prefill: {rpc_error(e)}"
            ) from e
        if not reply.ok:
            raise TransferFailed(f"prefill worker refused the progress call: {reply.error}")
        return reply

    def _advance(self, load: StagedLoad, reply) -> KVTransferParams | None:
        """One Progress reply: stage what became final; returns the completed params once
        the prefill kept the KV (None: ask again)."""
        params = load.params
        if reply.state == "ended":
            raise TransferFailed("the prefill ended without keeping the KV")
        if reply.state == "waiting":  # answered after waiting PROGRESS_WAIT_S there
            if time.monotonic() > load.admitted_by:
                raise TransferFailed("the prefill worker never admitted the request")
            return None
        if reply.epoch != load.epoch:  # first reply, or the prefill was preempted
            if load.have != load.base:  # what was staged came from freed blocks
                self._conn._count(staged_void=1)
            load.have, load.epoch = list(load.base), reply.epoch
        if reply.state == "kept":
            return params.completed(
                [g.ids for g in reply.block_ids],
                reply.first_token,
                EngineId(reply.engine_id),
                reply.fingerprint,
            )
        if load.want > params.prompt_len:
            return None
        dst, have = load.dst, load.have
        ready = [len(g.ids) for g in reply.block_ids] or [0] * len(dst)
        if len(ready) != len(dst):
            raise TransferFailed(f"the prefill worker names {len(ready)} groups")
        stageable = [g.kind != "state" for g in self._conn.layout.groups]
        end = [
            max(have[g], min(ready[g], len(dst[g]))) if stageable[g] else have[g]
            for g in range(len(dst))
        ]
        if sum(end) - sum(have) < STAGE_MIN_BLOCKS:
            return None
        src = [list(reply.block_ids[g].ids[have[g] : end[g]]) for g in range(len(dst))]
        try:
            st = self._pull_stage(load, end, src)
        except Refused as e:
            load.void += 1
            self._conn._count(staged_void=1)
            logger.info("staged pull of %s refused (%s)", params.request_id, e)
            load.have = list(load.base)  # what the refused pull wrote is garbage: again
            return None
        load.have = end
        load.moved[0] += st.bytes
        load.moved[1] += st.messages
        return None

    def _pull_stage(self, load: StagedLoad, end, src) -> TransferStats:
        """One staged pull: group g's blocks have[g] .. end[g]. Raises Refused when the
        prefill worker refused or voided it (the blocks changed there), TransferFailed when
        it failed."""
        t0 = time.perf_counter()
        have = load.have
        part = [d[a:b] for d, a, b in zip(load.dst, have, end, strict=True)]
        stage = {"skip_blocks": have, "stage_epoch": load.epoch, "stage_end": end}
        reply = self._conn._transfer(load.peer, load.params, src, part, "a staged pull", **stage)
        self._conn._count(staged_pulls=1, staged_bytes=reply.bytes, bytes=reply.bytes)
        return TransferStats(reply.bytes, reply.messages, time.perf_counter() - t0)

    def _final_pull(self, load: StagedLoad, final: KVTransferParams) -> LoadResult:
        """The prefill kept the KV: pull the rest; how the load ended."""
        staged = sum(load.have) - sum(load.base)
        st = self._conn.pull(final, load.block_ids, release=False, held=load.have, staged=staged)
        return LoadResult(
            load.request_id,
            None,
            st.bytes + load.moved[0],
            st.messages + load.moved[1],
            st.seconds,  # what the request waited once the prefill ended
            first_token=final.first_token,
            staged_bytes=load.moved[0],
        )

    def _end(
        self,
        load: StagedLoad,
        error: BaseException | None,
        final: KVTransferParams | None = None,
        res: LoadResult | None = None,
    ) -> None:
        """The load ended (`res`, or `error`): tell the engine, start a queued load, and
        release the KV (success) or give it up (an error after the prefill kept it)."""
        with self._lock:
            if self._loads.get(load.params.request_id) is load:
                del self._loads[load.params.request_id]
            self._active -= 1
            nxt = self._queue.popleft() if self._queue and not self._closing else None
            if nxt is not None:
                self._active += 1
        if error is not None:
            if not isinstance(error, TransferFailed):
                logger.error("staged KV load for %s failed", load.request_id, exc_info=error)
                text = f"{type(error).__name__}: {error}"
            else:
                text = str(error)
            first = final.first_token if final is not None else None
            res = LoadResult(load.request_id, text, first_token=first)
            logger.warning("staged KV load for %s failed: %s", load.request_id, text)
            # With the first token known the engine recomputes: the KV is not needed.
            # Without it the proxy may still hand the kept KV to another decode leg: leave
            # the lease.
            if final is not None:
                self._conn.abort_later(final)
        self._conn.finish_load(res)
        if res.error is None:
            self._conn.release_after(final)
        if nxt is not None:
            self._submit(self._begin, nxt)
