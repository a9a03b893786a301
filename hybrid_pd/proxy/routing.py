"""Where a request runs: the pool of workers the proxy picks from (the gRPC request pieces
are in `calls.py`).

Prefill workers are picked by the fewest outstanding prefill tokens (counted by the proxy);
decode workers by health, KV headroom and load (Stats refreshed at most every
`stats_interval_ms`, plus the proxy's own count of streams it has open on each). With
KV-aware routing (`kv_routing="prefix"`, the default) each worker within `max_imbalance`
requests of the least loaded gets a cost in tokens: those of the request it was never sent
(`PrefixIndex`: it must compute or pull them) plus its load (prefill: the prompt tokens
queued on it; decode: `load_weight` times the request's tokens per stream it runs); the
cheapest wins. A conversation's next turn so returns to the worker holding its earlier
turns unless that one is clearly busier, and new conversations sharing a system prompt
still spread.

Busy is not dead. A worker is dead when a call is refused at the connection (UNAVAILABLE)
or when its Stats keep failing for `dead_after_s`; a slow answer alone never removes it.
A worker that answered RESOURCE_EXHAUSTED (its queue is full) is skipped for a moment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proxy.prefix_index import PrefixIndex, block_hashes
from hybrid_pd.proxy.worker_client import WorkerClient

logger = logging.getLogger(__name__)

#: A worker whose RPC failed is skipped for this long (unless a Stats call shows it is back).
FAILURE_COOLDOWN_S = 2.0
#: Below this fraction of free KV blocks a decode worker is picked only when all are as full.
LOW_BLOCKS_FRACTION = 0.1
#: A worker whose queue was full is skipped for this long.
FULL_BACKOFF_S = 0.1
#: Block size assumed for KV-aware routing until a worker's Stats give its own.
DEFAULT_BLOCK_SIZE = 16


def _block_size(w: WorkerState) -> int:
    return int((w.stats or {}).get("block_size") or DEFAULT_BLOCK_SIZE)


@dataclass(eq=False)
class WorkerState:
    address: str
    client: WorkerClient
    roles: set[str] = field(default_factory=set)
    outstanding_prefill_tokens: int = 0
    outstanding_prefills: int = 0
    outstanding_decodes: int = 0
    stats: dict | None = None
    stats_at: float = -1e9  # monotonic time of the last Stats attempt
    healthy: bool = True
    failed_at: float = -1e9
    last_error: str = ""
    refreshing: bool = False
    #: Since when Stats have failed without the connection being refused (None: they work).
    failing_since: float | None = None
    #: Its queue was full: skipped until then.
    full_until: float = -1e9
    #: Decode role: prefill workers it has said it knows (None: not known yet).
    peers: set[str] | None = None

    def is_full(self, now: float) -> bool:
        return now < self.full_until

    def recently_failed(self, now: float) -> bool:
        return now - self.failed_at < FAILURE_COOLDOWN_S

    def decode_key(self, now: float) -> tuple:
        """Smaller is better: healthy, not short of KV blocks, least loaded, most free."""
        s = self.stats or {}
        free = int(s.get("free_blocks", 0))
        total = int(s.get("num_blocks", 0)) or 1
        low = self.stats is not None and free < LOW_BLOCKS_FRACTION * total
        # Stats lag behind: the proxy's own open streams are the fresher count.
        load = max(int(s.get("running", 0)) + int(s.get("waiting", 0)), self.outstanding_decodes)
        unhealthy = not self.healthy or self.recently_failed(now)
        return (unhealthy, low, load, -free / total, self.address)


class WorkerPool:
    """WorkerClients by role, with the proxy's bookkeeping. Thread-safe; blocking calls
    (Stats) happen in `refresh`, which callers on an event loop run in a thread."""

    def __init__(
        self,
        prefill: Iterable[str | WorkerClient] = (),
        decode: Iterable[str | WorkerClient] = (),
        *,
        secret: str | None = None,
        timeout_s: float = 600.0,
        stats_interval_ms: int = 500,
        control_timeout_s: float = 2.0,
        dead_after_s: float = 10.0,
        kv_routing: str = "prefix",
        max_imbalance: int = 4,
        load_weight: float = 0.5,
    ) -> None:
        self._lock = threading.Lock()
        #: KV-aware routing ("prefix"): what each worker was sent (see PrefixIndex).
        self.kv_routing = kv_routing
        self.max_imbalance = max_imbalance
        self.load_weight = load_weight
        self.prefixes = PrefixIndex()
        self.dead_after_s = dead_after_s
        self.stats_interval_s = stats_interval_ms / 1000.0
        self.control_timeout_s = control_timeout_s
        self.workers: dict[str, WorkerState] = {}
        self._owned: list[WorkerClient] = []
        for role, items in (("prefill", prefill), ("decode", decode)):
            for item in items:
                address = item if isinstance(item, str) else item.address
                if address not in self.workers:
                    if isinstance(item, str):
                        client = WorkerClient(item, secret=secret, timeout_s=timeout_s)
                        self._owned.append(client)
                    else:
                        client = item
                    self.workers[address] = WorkerState(address, client)
                self.workers[address].roles.add(role)

    @classmethod
    def from_config(cls, config) -> WorkerPool:
        return cls(
            config.prefill_addresses,
            config.decode_addresses,
            secret=config.secret,
            timeout_s=config.request_timeout_s,
            stats_interval_ms=config.stats_interval_ms,
            control_timeout_s=config.control_timeout_s,
            dead_after_s=config.dead_after_s,
            kv_routing=config.kv_routing,
            max_imbalance=config.kv_routing_max_imbalance,
            load_weight=config.kv_routing_load_weight,
        )

    def close(self) -> None:
        for client in self._owned:
            client.close()

    def sync(
        self,
        prefill: Iterable[str],
        decode: Iterable[str],
        *,
        secret: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        """Make the pool hold exactly these addresses (a restarted worker comes back on a
        new port): new ones are added, vanished ones dropped with their bookkeeping."""
        wanted: dict[str, set[str]] = {}
        for role, items in (("prefill", prefill), ("decode", decode)):
            for address in items:
                wanted.setdefault(address, set()).add(role)
        with self._lock:
            for address in list(self.workers):
                if address not in wanted:
                    gone = self.workers.pop(address)
                    self.prefixes.forget(address)
                    if gone.client in self._owned:
                        self._owned.remove(gone.client)
                        gone.client.close()
            for address, roles in wanted.items():
                if address not in self.workers:
                    client = WorkerClient(address, secret=secret, timeout_s=timeout_s)
                    self._owned.append(client)
                    self.workers[address] = WorkerState(address, client)
                self.workers[address].roles = set(roles)

    def with_role(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if role in w.roles]

    # -- picking ----------------------------------------------------------------------------
    def pick_prefill(
        self, exclude: Iterable[WorkerState] = (), tokens: Sequence[int] = ()
    ) -> WorkerState | None:
        """Blocking (may refresh Stats): fewest outstanding prefill tokens, or (KV-aware
        routing, `tokens` given) the worker likely to hold their longest prefix; workers
        that just failed are skipped."""
        self.refresh("prefill")
        now = time.monotonic()
        skip = set(map(id, exclude))
        with self._lock:
            ready = [
                w
                for w in self.with_role("prefill")
                if id(w) not in skip
                and w.healthy
                and not w.recently_failed(now)
                and not w.is_full(now)
            ]
            if not ready:
                return None
            ready.sort(
                key=lambda w: (w.outstanding_prefill_tokens, w.outstanding_prefills, w.address)
            )
            # Prefill: the tokens queued ahead of it are its wait; the ones it lacks, its work.
            return self._by_prefix(
                ready,
                tokens,
                lambda w: w.outstanding_prefills,
                lambda w: w.outstanding_prefill_tokens,
            )

    def _by_prefix(
        self, ranked: list[WorkerState], tokens: Sequence[int], load, cost
    ) -> WorkerState:
        """KV-aware choice among `ranked` (best by load first). A worker's cost is the tokens
        of `tokens` it lacks (no recorded prefix) plus `cost(w)`, its load in tokens; the
        cheapest within `max_imbalance` of the least `load` wins, ties in `ranked`'s order.
        Routing by load (or no tokens): the first of `ranked`."""
        if self.kv_routing != "prefix" or not tokens:
            return ranked[0]
        least = min(load(w) for w in ranked)
        best, best_cost = ranked[0], None
        hashes: dict[int, list[bytes]] = {}
        for w in ranked:
            if load(w) > least + self.max_imbalance:
                continue
            bs = _block_size(w)
            if bs not in hashes:
                hashes[bs] = block_hashes(tokens, bs)
            missing = len(tokens) - self.prefixes.match(w.address, hashes[bs]) * bs
            c = missing + cost(w)
            if best_cost is None or c < best_cost:
                best, best_cost = w, c
        return best

    def note_tokens(self, w: WorkerState, tokens: Sequence[int]) -> None:
        """`w` was sent (and will cache) `tokens`: KV-aware routing sends their followers
        there."""
        if self.kv_routing == "prefix":
            self.prefixes.record(w.address, block_hashes(tokens, _block_size(w)))

    def pick_decode(
        self, exclude: Iterable[WorkerState] = (), tokens: Sequence[int] = ()
    ) -> WorkerState | None:
        """Blocking (may refresh Stats): the best healthy decode worker, or None. With
        KV-aware routing and `tokens`, the healthy one not short of blocks that likely holds
        their longest prefix (see `_by_prefix`)."""
        self.refresh("decode")
        now = time.monotonic()
        skip = set(map(id, exclude))
        with self._lock:
            ready = [
                w for w in self.with_role("decode") if id(w) not in skip and not w.is_full(now)
            ]
            if not ready:
                return None
            keys = {id(w): w.decode_key(now) for w in ready}
            ready.sort(key=lambda w: keys[id(w)])
            if keys[id(ready[0])][0]:
                return None
            # Only among the healthy with blocks to spare: (unhealthy, low) as the best's.
            fine = [w for w in ready if keys[id(w)][:2] == keys[id(ready[0])][:2]]
            # Decode: each stream it runs costs `load_weight` of this prompt's tokens (a turn
            # moves away from its history only past that), the blocks it lacks are pulled.
            per_stream = self.load_weight * len(tokens)
            return self._by_prefix(
                fine, tokens, lambda w: keys[id(w)][2], lambda w: per_stream * keys[id(w)][2]
            )

    # -- bookkeeping ------------------------------------------------------------------------
    def begin_prefill(self, w: WorkerState, num_tokens: int) -> None:
        with self._lock:
            w.outstanding_prefills += 1
            w.outstanding_prefill_tokens += num_tokens

    def end_prefill(self, w: WorkerState, num_tokens: int) -> None:
        with self._lock:
            w.outstanding_prefills -= 1
            w.outstanding_prefill_tokens -= num_tokens

    def begin_decode(self, w: WorkerState) -> None:
        with self._lock:
            w.outstanding_decodes += 1

    def end_decode(self, w: WorkerState) -> None:
        with self._lock:
            w.outstanding_decodes -= 1

    def mark_failed(self, w: WorkerState, error: str) -> None:
        with self._lock:
            w.healthy = False
            w.failed_at = time.monotonic()
            w.last_error = error

    def mark_ok(self, w: WorkerState) -> None:
        with self._lock:
            w.healthy = True
            w.failed_at = -1e9
            w.last_error = ""
            w.failing_since = None

    def mark_full(self, w: WorkerState) -> None:
        """Its queue is full (RESOURCE_EXHAUSTED): alive, but skip it for a moment."""
        with self._lock:
            w.full_until = time.monotonic() + FULL_BACKOFF_S

    def live(self, role: str) -> bool:
        """Whether some worker of `role` is up (healthy, or only briefly failed)."""
        now = time.monotonic()
        with self._lock:
            return any(w.healthy and not w.recently_failed(now) for w in self.with_role(role))

    # -- stats ------------------------------------------------------------------------------
    def refresh(self, role: str | None = None, force: bool = False) -> None:
        """Blocking: Stats of workers (of `role`, or all) older than the interval."""
        now = time.monotonic()
        todo = []
        with self._lock:
            for w in self.workers.values():
                if role is not None and role not in w.roles:
                    continue
                if w.refreshing or (not force and now - w.stats_at < self.stats_interval_s):
                    continue
                w.refreshing = True
                w.stats_at = now
                todo.append(w)
        for w in todo:
            try:
                stats = w.client.stats(timeout_s=self.control_timeout_s)
            except Exception as e:  # grpc.RpcError, or a worker that answers garbage
                now = time.monotonic()
                refused = _code_name(e) == "UNAVAILABLE"
                with self._lock:
                    w.refreshing = False
                    w.last_error = _describe(e)
                    if w.failing_since is None:
                        w.failing_since = now
                    if refused or now - w.failing_since >= self.dead_after_s:
                        w.healthy = False
                        w.failed_at = now
                continue
            self._introduce_peers(w, stats)
            with self._lock:
                w.refreshing = False
                w.stats = stats
                w.healthy = True
                w.failed_at = -1e9
                w.last_error = ""
                w.failing_since = None

    def _introduce_peers(self, w: WorkerState, stats: dict) -> None:
        """A decode worker pulls KV only from prefill workers it knows: tell it ours."""
        if "decode" not in w.roles or "peers" not in stats:
            return
        with self._lock:
            ours = {p.address for p in self.with_role("prefill")}
            w.peers = set(stats["peers"])
        self._add_peers(w, ours - set(stats["peers"]))

    def _add_peers(self, w: WorkerState, addresses: set[str]) -> None:
        if not addresses:
            return
        try:
            known = w.client.add_peers(sorted(addresses), timeout_s=self.control_timeout_s)
        except Exception as e:  # its pulls from them fail (and recompute) until next time
            logger.warning("could not register prefill workers with %s: %s", w.address, e)
            return
        with self._lock:
            w.peers = set(known)

    def knows_peer(self, w: WorkerState, prefill_address: str) -> bool:
        with self._lock:
            return w.peers is not None and prefill_address in w.peers

    def ensure_peer(self, w: WorkerState, prefill_address: str) -> None:
        """Blocking: make sure decode worker `w` may pull from `prefill_address` before a
        request asks it to (a worker that just started may not have heard of it yet)."""
        if not self.knows_peer(w, prefill_address):
            self._add_peers(w, {prefill_address})

    def describe(self) -> pb.ModelCard | None:
        """Blocking: the model card of the first worker that answers (each asked once, within
        the control deadline), or None when none does."""
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            try:
                return w.client.describe(timeout_s=self.control_timeout_s)
            except Exception as e:  # down, or a worker too old to describe itself
                logger.debug("no model card from %s: %s", w.address, _describe(e))
        return None

    def check_health(self) -> list[dict]:
        """Blocking: ask every worker now; one entry per worker."""
        self.refresh(force=True)
        return self.snapshot()

    def decode_available(self) -> bool:
        with self._lock:
            return any(w.healthy for w in self.with_role("decode"))

    def snapshot(self) -> list[dict]:
        with self._lock:
            out = []
            for w in self.workers.values():
                s = w.stats or {}
                out.append(
                    {
                        "address": w.address,
                        "roles": sorted(w.roles),
                        "healthy": w.healthy,
                        "engine_id": s.get("engine_id"),
                        "num_blocks": s.get("num_blocks"),
                        "free_blocks": s.get("free_blocks"),
                        "running": s.get("running"),
                        "waiting": s.get("waiting"),
                        "outstanding_prefill_tokens": w.outstanding_prefill_tokens,
                        "outstanding_prefills": w.outstanding_prefills,
                        "outstanding_decodes": w.outstanding_decodes,
                        "last_error": w.last_error,
                    }
                )
            return out


def _code_name(e: BaseException) -> str | None:
    code = getattr(e, "code", None)
    if callable(code):
        try:
            return code().name
        except Exception:  # not a finished RPC
            return None
    return None


def _describe(e: BaseException) -> str:
    details = getattr(e, "details", None)
    code = getattr(e, "code", None)
    if callable(details) and callable(code):
        return f"{code().name}: {details()}"
    return f"{type(e).__name__}: {e}"
