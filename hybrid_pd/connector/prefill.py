"""Prefill side: keep handed-over blocks under a lease and serve pulls.

request_finished_all_groups ──► lease(request id, token, blocks, expiry)
PullKV(token, dst blocks) ──► UCX send of contiguous runs ──► reply (bytes, messages)
Release / Abort / lease expiry ──► free the blocks (exactly once)

Overlap (a Prefill that carries a transfer token): while the request computes, the engine
publishes its progress here (`stage_*`, engine thread); a decode worker follows it
(`progress`) and pulls the attention blocks whose tokens are all computed and which the
end of the prompt still reads (`pull_stage`): every full-attention block, a sliding
window's blocks from the final window's first. A block's KV never changes once computed, so
a staged send is exact unless the blocks were freed meanwhile (preemption): each free moves
the request's epoch on, and a send whose epoch moved before it ended is reported void (the
decode side pulls those blocks again). State pages come only with the final pull.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybrid_pd.api.params import KVTransferParams, prompt_digest
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.segments import PagedPlan, TransferPlan, group_regions, split_iov
from hybrid_pd.connector.tp_plan import ShardedPlan
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
#: How many ended request ids and early aborts a prefill connector remembers.
_REMEMBERED = 4096

#: Fault injection for the tests only: "exit_during_pull" makes the process exit after
#: sending part of a transfer; "zero_sends" sends zeros in place of the KV (the proof that
#: decode's output depends on what it pulls), "zero_sends:MARK" only for the requests whose
#: id contains MARK; "slow_prefill:SECONDS" sleeps that long after each step of a staged
#: request (so a test's decode worker sees its prefill in progress). Never set in production.
_FAULT, _, _FAULT_MARK = os.environ.get("HYBRID_PD_INJECT_FAULT", "").partition(":")


def _bounded_put(d: OrderedDict, key: str, value) -> None:
    """Remember `key`, forgetting the oldest entries past _REMEMBERED."""
    d[key] = value
    while len(d) > _REMEMBERED:
        d.popitem(last=False)


def _skipped(groups: Sequence[Sequence[int]], skip: Sequence[int]) -> Sequence[Sequence[int]]:
    """`groups` without each group's first `skip[g]` blocks (`skip` empty: all of them)."""
    if not skip:
        return groups
    if len(skip) != len(groups):
        raise ValueError(f"skip names {len(skip)} groups but the request has {len(groups)}")
    if any(not 0 <= n <= len(g) for g, n in zip(groups, skip, strict=True)):
        raise ValueError(f"skip {list(skip)} outside the kept blocks")
    return [g[n:] for g, n in zip(groups, skip, strict=True)]


def _die_mid_transfer(transport, peer: bytes, tag: int, regions: list) -> None:
    first = regions[0]
    half = first[: max(1, first.shape[0] // 2)]
    transport.send(peer, tag, [half], 10.0)
    logger.error("fault injection: exiting in the middle of a KV transfer")
    os._exit(17)


@dataclass
class Lease:
    request_id: str
    token: str
    block_ids: tuple[tuple[int, ...], ...]
    expires_at: float
    pulling: int = 0
    #: Released or aborted while a pull was sending: free when the pull ends.
    free_after_pull: bool = False
    first_token: int = -1
    #: The staging epoch the blocks were computed under (0: the request was not staged).
    epoch: int = 0


@dataclass
class _Stage:
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


class PrefillConnector:
    """Implements SupportsHMA for the prefill role."""

    def __init__(
        self,
        *,
        engine_id: str,
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
    ) -> None:
        """`free_blocks(request_id)` frees a kept request in the engine (thread-safe);
        `region(first_block, n)` returns the contiguous tensor of n blocks of our engine's
        pool; another cache layout gives a `plan` instead. `transport` sends regions
        (UcxTransport).

        `keep_wait_s`: where `keep` reaches this object after the params reach the client
        (vLLM: the engine core hands them out, the worker process keeps at its next step),
        a pull for a request not kept yet waits this long for it, and an abort that comes
        first is remembered and applied when the keep arrives."""
        if (region is None) == (plan is None):
            raise ValueError("give exactly one of region and plan")
        self.engine_id = engine_id
        self.layout = layout
        self.control_address = control_address
        self._free_blocks = free_blocks
        self._plan = plan if plan is not None else PagedPlan(region, layout.page_size_bytes)
        #: This worker's ranks' pools in rank order (`connector.tp_plan`), for pulls
        #: between tensor-parallel groups.
        self._shard_buffers = shard_buffers
        self.transport = transport
        self.lease_s = lease_s
        self._clock = clock
        self.keep_wait_s = keep_wait_s
        self._lock = threading.Lock()
        self._kept = threading.Condition(self._lock)
        self._leases: dict[str, Lease] = {}
        # Request ids whose lease ended (a pull for them fails at once) and aborts that
        # came before their keep (id -> token); both bounded, oldest dropped first.
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._early_aborts: OrderedDict[str, str] = OrderedDict()
        self._stages: dict[str, _Stage] = {}
        #: The groups a staged pull may send: attention (a computed block is final), never
        #: state pages (the state advances until the prompt ends).
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
        }

    # -- SupportsHMA ------------------------------------------------------------------------
    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        kept = tuple(tuple(b for b in g if b != NULL_BLOCK_ID) for g in block_ids)
        token = getattr(request, "stage_token", None) or secrets.token_urlsafe(32)
        self.keep(request.request_id, token, kept, first_token=request.output_ids[0])
        params = KVTransferParams(
            request_id=request.request_id,
            block_ids=kept,
            prompt_len=len(request.prompt_ids),
            first_token=request.output_ids[0],
            engine_id=self.engine_id,
            control_address=self.control_address,
            fingerprint=self.layout.fingerprint,
            transfer_token=token,
            prompt_digest=prompt_digest(request.prompt_ids),
        )
        return True, params.to_dict()

    def keep(
        self,
        request_id: str,
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
            if early is None or not hmac.compare_digest(early.encode(), token.encode()):
                self._leases[request_id] = lease
                self._kept.notify_all()
                return
            self.stats["aborted"] += 1
            _bounded_put(self._ended, request_id, None)
        logger.info("%s was aborted by its decode worker before it was kept", request_id)
        self._free(lease)

    def _wait_kept(self, request_id: str, timeout: float) -> None:
        """Under the lock: wait for a keep that may still be on its way."""
        if self.keep_wait_s <= 0:
            return
        deadline = self._clock() + min(self.keep_wait_s, timeout)
        while request_id not in self._leases and request_id not in self._ended:
            left = deadline - self._clock()
            if left <= 0 or not self._kept.wait(left):
                return

    # -- staging (engine thread) ------------------------------------------------------------
    def stage_begin(self, request_id: str, token: str) -> None:
        """A request admitted with a transfer token: decode may follow its progress."""
        with self._lock:
            self._stages[request_id] = _Stage(token)
            self.stats["staged"] += 1

    def stage_progress(
        self, request_id: str, num_computed: int, block_ids: Sequence[Sequence[int]]
    ) -> None:
        """After a step: the prompt tokens computed and, per group, the blocks whose KV is
        final, in the order the kept KV will list them (the engine's `_final_blocks`)."""
        if _FAULT == "slow_prefill":
            time.sleep(float(_FAULT_MARK))
        with self._lock:
            stage = self._stages.get(request_id)
            if stage is None:
                return
            stage.computed = num_computed
            stage.block_ids = tuple(
                tuple(g) if ok else () for g, ok in zip(block_ids, self._stageable, strict=True)
            )

    def stage_reset(self, request_id: str) -> None:
        """The request's blocks were freed (preempted; it will be computed again): blocks
        staged before now must be pulled again. Call before anything can reuse them."""
        with self._lock:
            stage = self._stages.get(request_id)
            if stage is not None:
                stage.epoch += 1
                stage.computed = 0
                stage.block_ids = ()

    def stage_end(self, request_id: str) -> None:
        """The request ended without keeping its KV (its first token finished it, it was
        aborted or it failed). Call before its blocks can be reused."""
        with self._lock:
            if self._stages.pop(request_id, None) is not None:
                _bounded_put(self._ended, request_id, None)

    def progress(self, request_id: str, token: str) -> Progress:
        """Where a staged request is (any thread; raises TransferFailed on a wrong token)."""
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

    def _epoch_of(self, request_id: str) -> int:
        """Under the lock: the staging epoch whose blocks `request_id` holds now (0: none)."""
        stage = self._stages.get(request_id)
        if stage is not None:
            return stage.epoch
        lease = self._leases.get(request_id)
        return lease.epoch if lease is not None else 0

    def pull_stage(
        self,
        request_id: str,
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
            runs = plan.runs(src, dst_blocks)
        except ValueError as e:
            raise TransferFailed(f"request {request_id}: {e}") from e
        messages = self._messages(plan, runs, message_regions, request_id, peer, tag)
        self.transport.send(peer, tag, messages, timeout)
        nbytes = plan.nbytes(runs)
        with self._lock:
            if self._epoch_of(request_id) != epoch:
                self.stats["staged_void"] += 1
                raise TransferFailed(f"request {request_id}: its blocks were freed while sent")
            self.stats["staged_pulls"] += 1
            self.stats["staged_bytes"] += nbytes
            self.stats["bytes_sent"] += nbytes
            self.stats["messages_sent"] += len(messages)
        return PullResult(nbytes, len(messages))

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

    # -- control handlers -------------------------------------------------------------------
    def _check_token(self, expected: str, token: str, request_id: str) -> None:
        if not hmac.compare_digest(expected.encode(), token.encode()):
            self.stats["bad_token"] += 1
            logger.warning("rejected a KV call for %s: wrong transfer token", request_id)
            raise TransferFailed(f"wrong transfer token for request {request_id!r}")

    def _lease(self, request_id: str, token: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise TransferFailed(
                f"no KV kept for request {request_id!r} (expired, released or never handed over)"
            )
        self._check_token(lease.token, token, request_id)
        return lease

    def pull(
        self,
        request_id: str,
        token: str,
        dst_blocks: list[list[int]],
        peer: bytes,
        tag: int,
        timeout: float = 30.0,
        skip: Sequence[int] = (),
        message_regions: Sequence[int] = (),
        dst_layout: KVLayout | None = None,
    ) -> PullResult:
        """Send the request's kept blocks to `peer` into `dst_blocks` (per group). `skip[g]`:
        decode holds group g's first kept blocks already; only the rest are sent.
        `message_regions[i]`: how many regions message i carries (scatter-gather); empty:
        one message per region. `dst_layout`: the decode worker's, when either side is
        tensor-parallel."""
        plan = self._plan_for(dst_layout)
        with self._lock:
            self._wait_kept(request_id, timeout)
            lease = self._lease(request_id, token)
            lease.pulling += 1
            lease.expires_at = max(lease.expires_at, self._clock() + self.lease_s)
        try:
            runs = plan.runs(_skipped(lease.block_ids, skip), dst_blocks)
            messages = self._messages(plan, runs, message_regions, request_id, peer, tag)
            self.transport.send(peer, tag, messages, timeout)
        except ValueError as e:
            raise TransferFailed(f"request {request_id}: {e}") from e
        finally:
            with self._lock:
                lease.pulling -= 1
                free_now = lease.free_after_pull and lease.pulling == 0
            if free_now:
                self._free(lease)
        nbytes = plan.nbytes(runs)
        with self._lock:
            self.stats["pulled"] += 1
            self.stats["bytes_sent"] += nbytes
            self.stats["messages_sent"] += len(messages)
        return PullResult(nbytes, len(messages))

    def _plan_for(self, dst_layout: KVLayout | None):
        """The plan for a pull into a decode worker of `dst_layout` (None: one rank there,
        and here unless this worker is tensor-parallel)."""
        if dst_layout is None and self.layout.tp_size == 1:
            return self._plan
        if dst_layout is None:
            raise TransferFailed("a pull from a tensor-parallel worker must give its layout")
        diff = self.layout.difference(dst_layout)
        if diff:
            raise TransferFailed(diff)
        if self._shard_buffers is None:
            raise TransferFailed("this worker cannot send to a tensor-parallel peer")
        return ShardedPlan(self.layout, dst_layout, self._shard_buffers)

    def _messages(
        self, plan, runs, message_regions, request_id: str, peer: bytes, tag: int
    ) -> list:
        """What the transport sends: the runs' regions, packed as the puller said (rows of
        the pools when the plan has them; fault injection works on region tensors)."""
        if message_regions and not _FAULT and isinstance(plan, (PagedPlan, ShardedPlan)):
            found = plan.iov(runs, "src")
            if found is not None:
                return split_iov(*found, message_regions)
        regions = plan.src_regions(runs)
        if _FAULT == "zero_sends" and _FAULT_MARK in request_id:
            regions = [r.new_zeros(r.shape) for r in regions]
        if _FAULT == "exit_during_pull":
            _die_mid_transfer(self.transport, peer, tag, regions)
        return group_regions(regions, message_regions) if message_regions else regions

    def stats_snapshot(self) -> dict:
        """A consistent copy of `stats`."""
        with self._lock:
            return dict(self.stats)

    def release(self, request_id: str, token: str, reason: str = "released") -> None:
        with self._lock:
            if (
                reason == "aborted"
                and self.keep_wait_s > 0
                and request_id not in self._leases
                and request_id not in self._ended
            ):
                # Its keep may still be on its way: apply the abort when it arrives.
                _bounded_put(self._early_aborts, request_id, token)
                return
            self._lease(request_id, token)
            lease = self._leases.pop(request_id)
            _bounded_put(self._ended, request_id, None)
            self.stats[reason] += 1
            if lease.pulling:  # the blocks are being read: free them when the pull ends
                lease.free_after_pull = True
                return
        self._free(lease)

    def abort_request(self, request_id: str) -> bool:
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
                _bounded_put(self._ended, lease.request_id, None)
                self.stats["expired"] += 1
        for lease in dead:
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
        for lease in leases:
            self._free(lease)
