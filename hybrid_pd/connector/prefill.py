"""Prefill side: keep handed-over blocks under a lease and serve pulls.

request_finished_all_groups ──► lease(request id, token, blocks, expiry)
PullKV(token, dst blocks) ──► UCX send of contiguous runs ──► reply (bytes, messages)
Release / Abort / lease expiry ──► free the blocks (exactly once)

Overlap (a Prefill that carries a transfer token): the staged half, `prefill_stage.Staging`.
Every change of a request's state fires its watchers (`watch`), which is what a KVControl
handler awaits (a Progress call, a pull that came before its keep): no handler polls.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_pd.api.params import KVTransferParams, prompt_digest
from hybrid_pd.api.signing import sign
from hybrid_pd.connector import faults, timeline
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.prefill_read import ReadConfirms
from hybrid_pd.connector.prefill_stage import (
    Progress,
    PullOrder,
    PullResult,
    Stage,
    Staging,
    remember,
)
from hybrid_pd.connector.segments import PagedPlan, TransferPlan, group_regions, split_iov
from hybrid_pd.connector.tp_plan import ShardedPlan
from hybrid_pd.connector.watch import Watchers, wait_until
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID, EngineId, RequestId

__all__ = ["DEFAULT_LEASE_S", "Lease", "PrefillConnector", "Progress", "PullResult"]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


def _skipped(groups: Sequence[Sequence[int]], skip: Sequence[int]) -> Sequence[Sequence[int]]:
    """`groups` without each group's first `skip[g]` blocks (`skip` empty: all of them)."""
    if not skip:
        return groups
    if len(skip) != len(groups):
        raise ValueError(f"skip names {len(skip)} groups but the request has {len(groups)}")
    if any(not 0 <= n <= len(g) for g, n in zip(groups, skip, strict=True)):
        raise ValueError(f"skip {list(skip)} outside the kept blocks")
    return [g[n:] for g, n in zip(groups, skip, strict=True)]


@dataclass
class Lease:
    request_id: RequestId
    token: str
    block_ids: tuple[tuple[int, ...], ...]
    expires_at: float
    pulling: int = 0
    #: Released or aborted while a pull was sending: free when the pull ends.
    free_after_pull: bool = False
    first_token: int = -1
    #: The staging epoch the blocks were computed under (0: the request was not staged).
    epoch: int = 0
    #: Releases still owed before the blocks are freed: set by the first pull of a decode
    #: rank that reads its own pieces (`ReadConfirms.confirm_read`) to the number of decode
    #: ranks reading from this rank; None: the first Release frees.
    readers: int | None = None


def handover_params(
    side: Any,
    request_id: RequestId,
    kept: tuple[tuple[int, ...], ...],
    prompt_ids: Sequence[int],
    first_token: int,
    transfer_token: str,
) -> KVTransferParams:
    """What a prefill side (ours, or vLLM's scheduler half: anything with `engine_id`,
    `control_address`, `layout`, `secret` and `lease_s`) hands out for a finished prompt
    whose blocks `kept` it keeps under `transfer_token`: signed for one lease when the side
    has the shared secret, so decode servers never told of it may pull (`api.signing`)."""
    params = KVTransferParams(
        request_id=request_id,
        block_ids=kept,
        prompt_len=len(prompt_ids),
        first_token=first_token,
        engine_id=side.engine_id,
        control_address=side.control_address,
        fingerprint=side.layout.fingerprint,
        transfer_token=transfer_token,
        prompt_digest=prompt_digest(prompt_ids),
    )
    return params if side.secret is None else sign(params, side.secret, side.lease_s)


@dataclass
class _Sending:
    """One pull being served: its lease (held against freeing), plan, runs and messages."""

    lease: Lease
    plan: object
    runs: object = None
    messages: list = field(default_factory=list)


class PrefillConnector(Staging, ReadConfirms):
    """Implements SupportsHMA for the prefill role (and the staged half, `Staging`; the
    one-sided reads' half, `ReadConfirms`)."""

    def __init__(
        self,
        *,
        engine_id: EngineId,
        layout: KVLayout,
        control_address: str,
        free_blocks: Callable[[str], None],
        transport,
        region: Callable[[int, int], object] | None = None,
        plan: TransferPlan | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        keep_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        shard_buffers: Callable[[], Sequence] | None = None,
        secret: str | None = None,
        one_sided: bool | None = None,
        rank_plans: Callable[[KVLayout, int], Any] | None = None,
    ) -> None:
        """`free_blocks(request_id)` frees a kept request in the engine (thread-safe);
        `region(first_block, n)` returns the contiguous tensor of n blocks of our engine's
        pool; another cache layout gives a `plan` instead. `transport` sends regions
        (UcxTransport).

        `keep_wait_s`: where `keep` reaches this object after the params reach the client
        (vLLM: the engine core hands them out, the worker process keeps at its next step),
        a pull for a request not kept yet waits this long for it, and an abort that comes
        first is remembered and applied when the keep arrives.

        `secret`: the control plane's shared secret; the params handed out are then signed
        with it (valid for the lease), so decode servers that were never told of this one
        may pull from it (`api.signing`). `one_sided`: offer decode workers this worker's
        memory to read (`connector.onesided`; default: unless HYBRID_PD_UCX_ONESIDED=0).

        `rank_plans(dst_layout, dst_rank)`: where each rank of a decode worker pulls its own
        pieces from this rank (vLLM's ranks, TP sizes differing), the plan of what rank
        `dst_rank` reads here (with `nbytes` and `readers`); raises TransferFailed when the
        two cannot be mapped."""
        if (region is None) == (plan is None):
            raise ValueError("give exactly one of region and plan")
        self.engine_id = engine_id
        self.layout = layout
        self.control_address = control_address
        self.secret = secret
        self._free_blocks = free_blocks
        self._plan = plan if plan is not None else PagedPlan(region, layout.page_size_bytes)
        #: This worker's ranks' pools in rank order (`connector.tp_plan`), for pulls
        #: between tensor-parallel groups.
        self._shard_buffers = shard_buffers
        #: Plans for tensor-parallel decode layouts, checked once per layout.
        self._tp_plans: dict[KVLayout, ShardedPlan] = {}
        self._rank_plans = rank_plans
        self.transport = transport
        self.lease_s = lease_s
        self._clock = clock
        self.keep_wait_s = keep_wait_s
        self._lock = threading.Lock()
        #: Fired with a request id whenever its state changes (see `watch`).
        self._watch = Watchers()
        self._leases: dict[str, Lease] = {}
        # Request ids whose lease ended (a pull for them fails at once) and aborts that
        # came before their keep (id -> token); both bounded, oldest dropped first.
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._early_aborts: OrderedDict[str, str] = OrderedDict()
        self._stages: dict[str, Stage] = {}
        self._stageable = tuple(g.kind != "state" for g in layout.groups)
        self.stats = {
            "handed_over": 0,
            "pulled": 0,
            "released": 0,
            "expired": 0,
            "aborted": 0,
            "bad_token": 0,
            "bytes_sent": 0,
            "messages_sent": 0,
            "staged": 0,  # requests whose progress decode could follow
            "staged_pulls": 0,
            "staged_bytes": 0,
            "staged_void": 0,  # staged sends whose blocks were freed meanwhile
            "read_pulls": 0,  # pulls decode read one-sided (confirmed here; none sent)
        }
        self._init_reads(one_sided)

    # -- SupportsHMA ------------------------------------------------------------------------
    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        kept = tuple(tuple(b for b in g if b != NULL_BLOCK_ID) for g in block_ids)
        token = getattr(request, "stage_token", None) or secrets.token_urlsafe(32)
        self.keep(request.request_id, token, kept, first_token=request.output_ids[0])
        params = handover_params(
            self, request.request_id, kept, request.prompt_ids, request.output_ids[0], token
        )
        return True, params.to_dict()

    def keep(
        self,
        request_id: RequestId,
        token: str,
        block_ids: tuple[tuple[int, ...], ...],
        first_token: int = -1,
    ) -> None:
        """Hold `block_ids` (per group, null blocks dropped) for a decode worker that shows
        `token`, until released, aborted or expired."""
        lease = Lease(
            request_id, token, block_ids, self._clock() + self.lease_s, first_token=first_token
        )
        with self._lock:
            stage = self._stages.pop(request_id, None)
            if stage is not None:
                lease.epoch = stage.epoch
            self.stats["handed_over"] += 1
            early = self._early_aborts.pop(request_id, None)
            aborted = early is not None and hmac.compare_digest(early.encode(), token.encode())
            if not aborted:
                self._leases[request_id] = lease
            else:
                self.stats["aborted"] += 1
                remember(self._ended, request_id, None)
        self._watch.fire(request_id)
        if aborted:
            logger.info("%s was aborted by its decode worker before it was kept", request_id)
            self._free(lease)

    # -- waiting for a request's state ------------------------------------------------------
    @property
    def watchers(self) -> Watchers:
        """Fired with a request id whenever that request's state changes: staged progress,
        preemption, keep, release, abort, expiry, end. What KVControl's handlers await."""
        return self._watch

    def settled(self, request_id: RequestId) -> bool:
        """Whether a pull for `request_id` can be answered now: its blocks are kept, or it
        ended (released, aborted, expired; a pull then fails at once)."""
        with self._lock:
            return request_id in self._leases or request_id in self._ended

    def keep_wait(self, timeout: float) -> float:
        """How long a pull may wait for its request's keep (0: never; `keep_wait_s`)."""
        return min(self.keep_wait_s, timeout) if self.keep_wait_s > 0 else 0.0

    # -- control handlers -------------------------------------------------------------------
    def _check_token(self, expected: str, token: str, request_id: RequestId) -> None:
        if not hmac.compare_digest(expected.encode(), token.encode()):
            self.stats["bad_token"] += 1
            logger.warning("rejected a KV call for %s: wrong transfer token", request_id)
            raise TransferFailed(f"wrong transfer token for request {request_id!r}")

    def _lease(self, request_id: RequestId, token: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise TransferFailed(
                f"no KV kept for request {request_id!r} (expired, released or never handed over)"
            )
        self._check_token(lease.token, token, request_id)
        return lease

    def pull(
        self,
        request_id: RequestId,
        token: str,
        dst_blocks: list[list[int]],
        peer: bytes,
        tag: int,
        timeout: float = 30.0,
        skip: Sequence[int] = (),
        message_regions: Sequence[int] = (),
        dst_layout: KVLayout | None = None,
        wait_for_keep: bool = True,
    ) -> PullResult:
        """Send the request's kept blocks as `PullOrder` (the same arguments) says, on this
        thread. `wait_for_keep`: a request not kept yet blocks this thread up to `keep_wait`
        for its keep; KVControl awaits that on its event loop (`settled`, `watchers`) and
        calls with False, so no handler thread waits."""
        order = PullOrder(
            request_id, token, dst_blocks, peer, tag, timeout, skip, message_regions, dst_layout
        )
        wait = self.keep_wait(timeout) if wait_for_keep else 0.0
        if wait > 0:
            wait_until(self._watch, request_id, lambda: self.settled(request_id), wait)
        sending = self._begin_pull(order)
        try:
            self.transport.send(peer, tag, sending.messages, timeout)
        except ValueError as e:
            raise TransferFailed(f"request {request_id}: {e}") from e
        finally:
            self._end_pull(sending)
        return self._pulled(sending)

    async def pull_async(self, order: PullOrder) -> PullResult:
        """`pull` for an event loop (KVControl's): the send is posted on the transport's
        loop and awaited there, with no thread of a pool in between (each hop is a thread
        to wake, which on a busy machine is where a pull's time went). Needs a transport
        with `send_future`; the caller has awaited the keep (`settled`)."""
        sending = self._begin_pull(order)
        try:
            if sending.messages:
                await asyncio.wrap_future(
                    self.transport.send_future(
                        order.peer, order.tag, sending.messages, order.timeout
                    )
                )
        except ValueError as e:
            raise TransferFailed(f"request {order.request_id}: {e}") from e
        finally:
            self._end_pull(sending)
        return self._pulled(sending)

    def _begin_pull(self, order: PullOrder) -> _Sending:
        """Check the token, hold the lease against freeing, and plan the messages."""
        o = order
        plan = self._plan_for(o.dst_layout)
        with self._lock:
            lease = self._lease(o.request_id, o.token)
            lease.pulling += 1
            lease.expires_at = max(lease.expires_at, self._clock() + self.lease_s)
        sending = _Sending(lease, plan)
        try:
            sending.runs = plan.runs(_skipped(lease.block_ids, o.skip), o.dst_blocks)
            sending.messages = self._messages(
                plan, sending.runs, o.message_regions, o.request_id, o.peer, o.tag
            )
        except ValueError as e:
            self._end_pull(sending)
            raise TransferFailed(f"request {o.request_id}: {e}") from e
        except BaseException:
            self._end_pull(sending)
            raise
        timeline.stamp(o.request_id, "sends_posted")
        return sending

    def _end_pull(self, sending: _Sending) -> None:
        """The send ended (or never started): a lease released meanwhile is freed now."""
        lease = sending.lease
        with self._lock:
            lease.pulling -= 1
            free_now = lease.free_after_pull and lease.pulling == 0
        if free_now:
            self._free(lease)

    def _pulled(self, sending: _Sending) -> PullResult:
        timeline.stamp(sending.lease.request_id, "sends_done")
        nbytes = sending.plan.nbytes(sending.runs)
        with self._lock:
            self.stats["pulled"] += 1
            self.stats["bytes_sent"] += nbytes
            self.stats["messages_sent"] += len(sending.messages)
        return PullResult(nbytes, len(sending.messages))

    def _plan_for(self, dst_layout: KVLayout | None, dst_rank: int | None = None):
        """The plan for a pull into a decode worker of `dst_layout` (None: one rank there,
        and here unless this worker is tensor-parallel); `dst_rank`: into that rank only,
        which reads its own pieces (`rank_plans`)."""
        if dst_rank is not None:
            if dst_layout is None or self._rank_plans is None:
                raise TransferFailed("this worker cannot serve a decode rank's own pieces")
            return self._rank_plans(dst_layout, dst_rank)
        if dst_layout is None and (self.layout.tp_size == 1 or self._shard_buffers is None):
            return self._plan  # one rank here, or rank paired with rank (vLLM's workers)
        if dst_layout is None:
            raise TransferFailed("a pull from a tensor-parallel worker must give its layout")
        plan = self._tp_plans.get(dst_layout)
        if plan is None:
            diff = self.layout.difference(dst_layout)
            if diff:
                raise TransferFailed(diff)
            if self._shard_buffers is None:
                raise TransferFailed("this worker cannot send to a tensor-parallel peer")
            plan = self._tp_plans[dst_layout] = ShardedPlan(
                self.layout, dst_layout, self._shard_buffers
            )
        return plan

    def refusal(self, dst_layout: KVLayout) -> str | None:
        """Why a decode worker of `dst_layout`, whose layout matches or maps onto ours,
        still cannot pull from here (its ranks reading their own pieces from caches of
        ours that are not as described: `rank_plans`); None when it can."""
        if self._rank_plans is None or dst_layout.tp_size == self.layout.tp_size:
            return None
        try:
            self._rank_plans(dst_layout, 0)
        except TransferFailed as e:
            return str(e)
        return None

    def _messages(
        self, plan, runs, message_regions, request_id: RequestId, peer: bytes, tag: int
    ) -> list:
        """What the transport sends: the runs' regions, packed as the puller said (rows of
        the pools when the plan has them; fault injection works on region tensors)."""
        if message_regions and not faults.FAULT and isinstance(plan, (PagedPlan, ShardedPlan)):
            found = plan.iov(runs, "src")
            if found is not None:
                return split_iov(*found, message_regions)
        regions = plan.src_regions(runs)
        if faults.zeroed(request_id):
            regions = [r.new_zeros(r.shape) for r in regions]
        if faults.FAULT == "exit_during_pull":
            faults.die_mid_transfer(self.transport, peer, tag, regions)
        return group_regions(regions, message_regions) if message_regions else regions

    def stats_snapshot(self) -> dict:
        """A consistent copy of `stats`."""
        with self._lock:
            return dict(self.stats)

    def release(self, request_id: RequestId, token: str, reason: str = "released") -> None:
        with self._lock:
            if (
                reason == "aborted"
                and self.keep_wait_s > 0
                and request_id not in self._leases
                and request_id not in self._ended
            ):
                # Its keep may still be on its way: apply the abort when it arrives.
                remember(self._early_aborts, request_id, token)
                return
            lease = self._lease(request_id, token)
            if reason == "released" and lease.readers is not None and lease.readers > 1:
                lease.readers -= 1  # another decode rank still reads its pieces here
                return
            self._leases.pop(request_id)
            remember(self._ended, request_id, None)
            self.stats[reason] += 1
            free_now = not lease.pulling  # else read now: freed when the pull ends
            lease.free_after_pull = not free_now
        self._watch.fire(request_id)
        if free_now:
            self._free(lease)

    def abort_request(self, request_id: RequestId) -> bool:
        """Drop a kept request by id alone (trusted callers: the proxy's Abort)."""
        with self._lock:
            lease = self._leases.get(request_id)
        if lease is None:
            return False
        self.release(request_id, lease.token, reason="aborted")
        return True

    def heartbeat(self, pairs: list[tuple[str, str]]) -> list[str]:
        """Extend leases; returns the request ids that are not (or no longer) kept."""
        unknown = []
        with self._lock:
            now = self._clock()
            for rid, token in pairs:
                lease = self._leases.get(rid)
                if lease is None or not hmac.compare_digest(lease.token.encode(), token.encode()):
                    unknown.append(rid)
                else:
                    lease.expires_at = now + self.lease_s
        return unknown

    def expire(self) -> int:
        """Free every lease past its expiry that is not being pulled; returns how many."""
        with self._lock:
            now = self._clock()
            dead = [ls for ls in self._leases.values() if ls.expires_at < now and not ls.pulling]
            for lease in dead:
                del self._leases[lease.request_id]
                remember(self._ended, lease.request_id, None)
                self.stats["expired"] += 1
        for lease in dead:
            self._watch.fire(lease.request_id)
            logger.warning("lease of %s expired; freeing its blocks", lease.request_id)
            self._free(lease)
        return len(dead)

    def _free(self, lease: Lease) -> None:
        self._free_blocks(lease.request_id)

    @property
    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        """Free every kept request (worker shutdown)."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        self._watch.fire_all()
        for lease in leases:
            self._free(lease)
