"""Which prefill ranks one vLLM worker rank moves KV with, and the plans for them.

Equal TP sizes pair rank r with the peer server's rank r (whole blocks of its own caches).
Different sizes (`rank_plan`): a decode rank reads its pieces one-sided from every prefill
rank holding some, addressed as rank 0's control address plus the rank (`rank_address`),
and a prefill rank counts what each decode rank read from it. Rank 0's handshake tells a
decode rank the prefill server's size, once per server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.vllm.options import rank_address
from hybrid_pd.connector.vllm.rank_plan import RankPlan, check_views, sources, unread
from hybrid_pd.kvcache.tp_layout import TPLayoutError

logger = logging.getLogger(__name__)


class RankSources:
    """One worker rank's side of transfers between servers (see the module docstring).
    `views`: its `VllmPlan` views per group. `decode`: its DecodeConnector once made."""

    def __init__(self, layout: KVLayout, rank: int, views: Sequence[Sequence]) -> None:
        self.layout, self.rank, self.views = layout, rank, views
        self.decode = None
        self._lock = threading.Lock()
        self._rank_of: dict[str, int] = {}  # a prefill rank's control address -> its rank
        self._sizes: dict[str, int] = {}  # a prefill server's rank-0 address -> its TP size
        self._prefill_plans: dict[tuple[KVLayout, int], RankPlan] = {}
        #: Why this rank's caches cannot move between TP sizes (None: they can).
        self.unmapped: str | None = None
        try:
            check_views(views, layout)
        except TPLayoutError as e:
            self.unmapped = f"vLLM's caches here are not mapped between TP sizes: {e}"

    def _check(self) -> None:
        if self.unmapped is not None:
            raise TransferFailed(self.unmapped)

    # -- decode ------------------------------------------------------------------------------
    def decode_plan(self, peer_layout: KVLayout, address: str) -> RankPlan:
        """DecodeConnector's `rank_plans`: this rank's pieces at the prefill rank at
        `address` (one whose rank this object named)."""
        self._check()
        with self._lock:
            rank = self._rank_of.get(address)
        if rank is None:
            raise TransferFailed(f"{address} is not a prefill rank this worker was sent to")
        try:
            return RankPlan(peer_layout, self.layout, rank, self.rank, self.views)
        except TPLayoutError as e:
            raise TransferFailed(str(e)) from None

    def _ranks(self, base: str) -> list[int]:
        """The ranks of the prefill server whose rank 0 serves at `base` that this rank
        pulls from (handshaking with rank 0 once)."""
        size = self.decode.peer_layout(base).tp_size
        with self._lock:
            self._sizes[base] = size
        return self._ranks_of(size)

    def _ranks_of(self, size: int) -> list[int]:
        if size == self.layout.tp_size:
            return [self.rank]
        try:
            rows = [g.rows for g in self.layout.groups]
            return sources(rows, size, self.layout.tp_size, self.rank)
        except TPLayoutError as e:
            raise TransferFailed(str(e)) from None

    def known_sources(self, params: KVTransferParams) -> list[KVTransferParams] | None:
        """The prefill ranks `sources` names (to pull from or release) without a
        handshake: None where the prefill server's size is not known yet (or its ranks
        cannot be mapped). For aborts: no wait on a step."""
        base = params.control_address
        with self._lock:
            size = self._sizes.get(base)
        if size is None:
            return None
        try:
            ranks = self._ranks_of(size)
        except TransferFailed:
            return None
        if size != self.layout.tp_size:
            rows = [g.rows for g in self.layout.groups]
            ranks += unread(rows, size, self.layout.tp_size, self.rank)
        return [dataclasses.replace(params, control_address=rank_address(base, r)) for r in ranks]

    def sources(self, params: KVTransferParams) -> tuple[list, list]:
        """`params` (rank 0's) addressed to each prefill rank this rank pulls from (its own
        rank's where the sizes are equal, else every rank holding a piece of its rows), and
        to the ranks it only releases (`rank_plan.unread`: every prefill rank keeps the
        blocks until released). Each address is let in as rank 0's is: known, or vouched
        for by the signed params."""
        base = params.control_address
        self.decode.admission.admit(params)  # a known peer, or signed params; not a replay
        self._let_in(params, base, 0)
        ranks = self._ranks(base)
        size = self._sizes[base]
        rest = []
        if size != self.layout.tp_size:
            rest = unread(
                [g.rows for g in self.layout.groups], size, self.layout.tp_size, self.rank
            )
        pull, release = [], []
        for r in ranks + rest:
            address = rank_address(base, r)
            self._let_in(params, address, r)
            (pull if r in ranks else release).append(
                dataclasses.replace(params, control_address=address)
            )
        return pull, release

    def _let_in(self, params: KVTransferParams, address: str, rank: int) -> None:
        with self._lock:
            self._rank_of[address] = rank
        admission = self.decode.admission
        if params.control_address in admission.known:
            admission.add([address])
        elif params.signature:
            try:
                admission.admit(params, address)
            except TransferFailed:
                pass  # the pull fails, saying why

    def dial(self, base: str) -> list[str]:
        """Handshake with the server whose rank 0 serves at `base` (a configured peer) and
        with each of its ranks this rank pulls from; returns their addresses."""
        with self._lock:
            self._rank_of[base] = 0
        out = []
        for r in self._ranks(base):
            address = rank_address(base, r)
            with self._lock:
                self._rank_of[address] = r
            self.decode.add_peers([address])
            self.decode.dial(address)
            out.append(address)
        return out

    # -- prefill -----------------------------------------------------------------------------
    def prefill_plan(self, dst_layout: KVLayout, dst_rank: int) -> RankPlan:
        """PrefillConnector's `rank_plans`: what decode rank `dst_rank` reads here."""
        self._check()
        key = (dst_layout, dst_rank)
        with self._lock:
            plan = self._prefill_plans.get(key)
        if plan is not None:
            return plan
        diff = self.layout.difference(dst_layout)
        if diff:
            raise TransferFailed(diff)
        if not 0 <= dst_rank < dst_layout.tp_size:
            raise TransferFailed(f"decode rank {dst_rank} of {dst_layout.tp_size}")
        try:
            plan = RankPlan(self.layout, dst_layout, self.rank, dst_rank)
        except TPLayoutError as e:
            raise TransferFailed(str(e)) from None
        with self._lock:
            return self._prefill_plans.setdefault(key, plan)
