"""Prefill side, staged: a decode worker follows a request still in prefill and pulls its
final attention blocks early (the overlap of the KV hand-over with the prefill).

While the request computes, the engine publishes its progress here (`stage_*`, engine
thread), and each publication fires the request's watchers, so a Progress call awaiting it
answers at once; a decode worker follows it (`progress`) and pulls the attention blocks whose
tokens are all computed and which the end of the prompt still reads (`pull_stage`): every
full-attention block, a sliding window's blocks from the final window's first. A block's KV
never changes once computed, so a staged send is exact unless the blocks were freed meanwhile
(preemption): each free moves the request's epoch on, and a send whose epoch moved before it
ended is reported void (the decode side pulls those blocks again). State pages come only with
the final pull.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from hybrid_pd.connector import faults
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.watch import Watchers
from hybrid_pd.kvcache.ids import RequestId

#: How many ended request ids and early aborts a prefill connector remembers.
REMEMBERED = 4096


def remember(d: OrderedDict, key: str, value) -> None:
    """Remember `key`, forgetting the oldest entries past REMEMBERED."""
    d[key] = value
    while len(d) > REMEMBERED:
        d.popitem(last=False)


@dataclass
class Stage:
    """A request in prefill whose decode worker may pull its computed blocks early."""

    token: str
    epoch: int = 1
    computed: int = 0
    block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Progress:
    """What `PrefillConnector.progress` tells a decode worker about a staged request."""

    state: str  # "waiting", "running", "kept" or "ended"
    epoch: int = 0
    computed: int = 0
    block_ids: tuple[tuple[int, ...], ...] = ()
    first_token: int = -1


@dataclass(frozen=True)
class PullResult:
    bytes: int
    messages: int


@dataclass(frozen=True)
class PullOrder:
    """What one pull asks the prefill side for: the request's kept blocks, sent to `peer`
    under `tag` into `dst_blocks` (per group) within `timeout` seconds. `skip[g]`: decode
    holds group g's first kept blocks already; only the rest are sent.
    `message_regions[i]`: how many regions message i carries (scatter-gather); empty: one
    message per region. `dst_layout`: the decode worker's, when either side is
    tensor-parallel."""

    request_id: RequestId
    token: str
    dst_blocks: list[list[int]]
    peer: bytes
    tag: int
    timeout: float = 30.0
    skip: Sequence[int] = ()
    message_regions: Sequence[int] = ()
    dst_layout: KVLayout | None = None


class Staging:
    """The staged half of `PrefillConnector` (a mixin: it shares the connector's lock,
    leases and plans). The connector provides the attributes annotated here, and `_lease`,
    `_check_token`, `_plan_for` and `_messages`."""

    _lock: threading.Lock
    _stages: dict[str, Stage]
    _leases: dict
    _ended: OrderedDict
    #: Per group: whether a staged pull may send it (attention: a computed block is
    #: final), never state pages (the state advances until the prompt ends).
    _stageable: tuple[bool, ...]
    _watch: Watchers
    stats: dict
    transport: object

    # -- the engine thread publishes ---------------------------------------------------------
    def stage_begin(self, request_id: RequestId, token: str) -> None:
        """A request admitted with a transfer token: decode may follow its progress."""
        with self._lock:
            self._stages[request_id] = Stage(token)
            self.stats["staged"] += 1
        self._watch.fire(request_id)

    def stage_progress(
        self, request_id: RequestId, num_computed: int, block_ids: Sequence[Sequence[int]]
    ) -> None:
        """After a step: the prompt tokens computed and, per group, the blocks whose KV is
        final, in the order the kept KV will list them (the engine's `_final_blocks`)."""
        faults.slow_step()
        with self._lock:
            stage = self._stages.get(request_id)
            if stage is None:
                return
            stage.computed = num_computed
            stage.block_ids = tuple(
                tuple(g) if ok else () for g, ok in zip(block_ids, self._stageable, strict=True)
            )
        self._watch.fire(request_id)

    def stage_reset(self, request_id: RequestId) -> None:
        """The request's blocks were freed (preempted; it will be computed again): blocks
        staged before now must be pulled again. Call before anything can reuse them."""
        with self._lock:
            stage = self._stages.get(request_id)
            if stage is None:
                return
            stage.epoch += 1
            stage.computed = 0
            stage.block_ids = ()
        self._watch.fire(request_id)

    def stage_end(self, request_id: RequestId) -> None:
        """The request ended without keeping its KV (its first token finished it, it was
        aborted or it failed). Call before its blocks can be reused."""
        with self._lock:
            if self._stages.pop(request_id, None) is None:
                return
            remember(self._ended, request_id, None)
        self._watch.fire(request_id)

    # -- decode workers follow ---------------------------------------------------------------
    def progress(self, request_id: RequestId, token: str) -> Progress:
        """Where a staged request is (any thread, never blocks; raises TransferFailed on a
        wrong token). Its watchers fire whenever the answer may have changed."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                self._lease(request_id, token)
                return Progress(
                    "kept", lease.epoch, 0, lease.block_ids, first_token=lease.first_token
                )
            stage = self._stages.get(request_id)
            if stage is not None:
                self._check_token(stage.token, token, request_id)
                return Progress("running", stage.epoch, stage.computed, stage.block_ids)
            return Progress("ended" if request_id in self._ended else "waiting")

    def _epoch_of(self, request_id: RequestId) -> int:
        """Under the lock: the staging epoch whose blocks `request_id` holds now (0: none)."""
        stage = self._stages.get(request_id)
        if stage is not None:
            return stage.epoch
        lease = self._leases.get(request_id)
        return lease.epoch if lease is not None else 0

    def pull_stage(
        self,
        request_id: RequestId,
        token: str,
        epoch: int,
        start: Sequence[int],
        end: Sequence[int],
        dst_blocks: list[list[int]],
        peer: bytes,
        tag: int,
        timeout: float = 30.0,
        message_regions: Sequence[int] = (),
        dst_layout: KVLayout | None = None,
    ) -> PullResult:
        """Send group g's final attention blocks start[g] .. end[g] of a request
        still in prefill (or just kept) into `dst_blocks[g]`. Raises TransferFailed when the
        epoch is not the request's, or moved while sending (the bytes sent are void)."""
        plan, runs = self._staged_runs(request_id, token, epoch, start, end, dst_blocks, dst_layout)
        messages = self._messages(plan, runs, message_regions, request_id, peer, tag)
        self.transport.send(peer, tag, messages, timeout)
        nbytes = plan.nbytes(runs)
        self._count_staged(request_id, epoch, nbytes, "sent", len(messages))
        return PullResult(nbytes, len(messages))

    def _staged_runs(self, request_id, token, epoch, start, end, dst_blocks, dst_layout):
        """(plan, runs) of group g's blocks start[g] .. end[g] of a staged request into
        `dst_blocks`. Raises TransferFailed unless the request holds them under `epoch`
        (counted void) or when the plan cannot map them."""
        with self._lock:
            stage = self._stages.get(request_id)
            if stage is not None:
                self._check_token(stage.token, token, request_id)
                blocks, now = stage.block_ids, stage.epoch
            else:
                lease = self._lease(request_id, token)
                blocks, now = lease.block_ids, lease.epoch
            if now != epoch:
                self.stats["staged_void"] += 1
                raise TransferFailed(f"request {request_id}: its blocks changed (preempted)")
            src = self._stage_src(blocks, start, end)
        plan = self._plan_for(dst_layout)
        try:
            return plan, plan.runs(src, dst_blocks)
        except ValueError as e:
            raise TransferFailed(f"request {request_id}: {e}") from e

    def _count_staged(
        self, request_id, epoch: int, nbytes: int, how: str, messages: int = 0
    ) -> None:
        """Count a staged pull whose bytes were `how` ("sent" in `messages`, or "read"
        one-sided); raises TransferFailed (void) when the request's epoch moved on meanwhile."""
        with self._lock:
            if self._epoch_of(request_id) != epoch:
                self.stats["staged_void"] += 1
                raise TransferFailed(f"request {request_id}: its blocks were freed while {how}")
            self.stats["staged_pulls"] += 1
            if how == "read":
                self.stats["read_pulls"] += 1
            self.stats["staged_bytes"] += nbytes
            self.stats["bytes_sent"] += nbytes
            self.stats["messages_sent"] += messages

    def _stage_src(self, blocks, start, end) -> list[list[int]]:
        """Under the lock: the source blocks of a staged pull, group g's final blocks
        start[g] .. end[g] (TransferFailed names what does not fit)."""
        if len(start) != len(self._stageable) or len(end) != len(self._stageable):
            raise TransferFailed(f"a staged pull names {len(start)} / {len(end)} groups")
        src = []
        for g, (a, b, ok) in enumerate(zip(start, end, self._stageable, strict=True)):
            have = blocks[g] if g < len(blocks) else ()
            if a == b:
                src.append([])
                continue
            if not ok or not 0 <= a < b <= len(have):
                raise TransferFailed(f"group {g}: blocks {a}..{b} are not final attention blocks")
            src.append(list(have[a:b]))
        return src
