"""Prefill side: keep handed-over blocks under a lease and serve pulls.

request_finished_all_groups ──► lease(request id, token, blocks, expiry)
PullKV(token, dst blocks) ──► UCX send of contiguous runs ──► reply (bytes, messages)
Release / Abort / lease expiry ──► free the blocks (exactly once)
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
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
#: How many ended request ids and early aborts a prefill connector remembers.
_REMEMBERED = 4096

#: Fault injection for the tests only: "exit_during_pull" makes the process exit after
#: sending part of a transfer; "zero_sends" sends zeros in place of the KV (the proof that
#: decode's output depends on what it pulls), "zero_sends:MARK" only for the requests whose
#: id contains MARK. Never set in production.
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
        self.stats = {
            "handed_over": 0,
            "pulled": 0,
            "released": 0,
            "expired": 0,
            "aborted": 0,
            "bad_token": 0,
            "bytes_sent": 0,
            "messages_sent": 0,
        }

    # -- SupportsHMA ------------------------------------------------------------------------
    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        kept = tuple(tuple(b for b in g if b != NULL_BLOCK_ID) for g in block_ids)
        token = secrets.token_urlsafe(32)
        self.keep(request.request_id, token, kept)
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

    def keep(self, request_id: str, token: str, block_ids: tuple[tuple[int, ...], ...]) -> None:
        """Hold `block_ids` (per group, null blocks dropped) for a decode worker that shows
        `token`, until released, aborted or expired."""
        lease = Lease(request_id, token, block_ids, self._clock() + self.lease_s)
        with self._lock:
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

    # -- control handlers -------------------------------------------------------------------
    def _lease(self, request_id: str, token: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise TransferFailed(
                f"no KV kept for request {request_id!r} (expired, released or never handed over)"
            )
        if not hmac.compare_digest(lease.token.encode(), token.encode()):
            self.stats["bad_token"] += 1
            logger.warning("rejected a KV call for %s: wrong transfer token", request_id)
            raise TransferFailed(f"wrong transfer token for request {request_id!r}")
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
    ) -> PullResult:
        """Send the request's kept blocks to `peer` into `dst_blocks` (per group). `skip[g]`:
        decode holds group g's first kept blocks already; only the rest are sent.
        `message_regions[i]`: how many regions message i carries (scatter-gather); empty:
        one message per region."""
        with self._lock:
            self._wait_kept(request_id, timeout)
            lease = self._lease(request_id, token)
            lease.pulling += 1
            lease.expires_at = max(lease.expires_at, self._clock() + self.lease_s)
        try:
            runs = self._plan.runs(_skipped(lease.block_ids, skip), dst_blocks)
            messages = self._messages(runs, message_regions, request_id, peer, tag)
            self.transport.send(peer, tag, messages, timeout)
        except ValueError as e:
            raise TransferFailed(f"request {request_id}: {e}") from e
        finally:
            with self._lock:
                lease.pulling -= 1
                free_now = lease.free_after_pull and lease.pulling == 0
            if free_now:
                self._free(lease)
        nbytes = self._plan.nbytes(runs)
        with self._lock:
            self.stats["pulled"] += 1
            self.stats["bytes_sent"] += nbytes
            self.stats["messages_sent"] += len(messages)
        return PullResult(nbytes, len(messages))

    def _messages(self, runs, message_regions, request_id: str, peer: bytes, tag: int) -> list:
        """What the transport sends: the runs' regions, packed as the puller said (rows of
        one pool when the plan has them; fault injection works on region tensors)."""
        if message_regions and not _FAULT and isinstance(self._plan, PagedPlan):
            found = self._plan.iov(runs, "src")
            if found is not None:
                return split_iov(*found, message_regions)
        regions = self._plan.src_regions(runs)
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
