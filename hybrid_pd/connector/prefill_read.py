"""Prefill side of one-sided pulls (`connector.onesided`): the memory offered to decode
workers, and the confirmation of a read they made (PullKV with read_done).

A confirmation succeeds only while the request's lease holds (and, for a staged read,
under the epoch the read was planned for): a lease, once ended, never comes back, and a
block it holds is never written, so what decode read is the kept KV. The reply's bytes
are what the plan says the runs hold; decode checks them against what it read.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from hybrid_pd.connector import faults, timeline
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.onesided import Exposure, prefill_regions
from hybrid_pd.connector.prefill_stage import PullResult
from hybrid_pd.kvcache.ids import RequestId

logger = logging.getLogger(__name__)


class ReadConfirms:
    """The one-sided half of `PrefillConnector` (a mixin: it shares the connector's lock,
    leases, stages and plans)."""

    _lock: threading.Lock
    stats: dict
    transport: object
    layout: KVLayout

    def _init_reads(self, one_sided: bool | None) -> None:
        self._exposure = Exposure(
            self.transport,
            lambda: prefill_regions(self._plan, self._shard_buffers, self.layout.tp_size),
            one_sided,
        )

    def remote_memory(self):
        """What the HandshakeReply offers decode workers to read (pb.RemoteMemory), mapped
        at the first call; None: they pull two-sided."""
        return self._exposure.describe()

    def confirm_read(
        self,
        request_id: RequestId,
        token: str,
        dst_blocks: list[list[int]],
        skip: Sequence[int] = (),
        dst_layout: KVLayout | None = None,
        dst_rank: int | None = None,
    ) -> PullResult:
        """A decode worker read the request's kept blocks (after the first `skip[g]` of
        group g) into `dst_blocks`: TransferFailed unless they are still kept (the read is
        then void); else the pull counts, its lease untouched (Release ends it).
        `dst_rank`: one rank of a decode worker read its own pieces from this rank; the
        lease then ends at the last Release of the decode ranks that read here."""
        from hybrid_pd.connector.prefill import _skipped

        _exit_if_injected()
        plan = self._plan_for(dst_layout, dst_rank)
        with self._lock:
            lease = self._lease(request_id, token)
            blocks = lease.block_ids
        try:
            runs = plan.runs(_skipped(blocks, skip), dst_blocks)
        except ValueError as e:
            raise TransferFailed(f"request {request_id}: {e}") from e
        nbytes = plan.nbytes(runs)
        with self._lock:
            lease = self._lease(request_id, token)  # still kept: the bytes read are the KV
            if dst_rank is not None and lease.readers is None:
                lease.readers = plan.readers
            self.stats["pulled"] += 1
            self.stats["read_pulls"] += 1
            self.stats["bytes_sent"] += nbytes
        timeline.stamp(request_id, "read_confirmed")
        return PullResult(nbytes, 0)

    def confirm_stage_read(
        self,
        request_id: RequestId,
        token: str,
        epoch: int,
        start: Sequence[int],
        end: Sequence[int],
        dst_blocks: list[list[int]],
        dst_layout: KVLayout | None = None,
    ) -> PullResult:
        """A decode worker read group g's final attention blocks start[g] .. end[g] of a
        staged request (`pull_stage`'s blocks): TransferFailed unless the request still
        holds them under `epoch` (a free moves the epoch on: the read is void)."""
        plan, runs = self._staged_runs(request_id, token, epoch, start, end, dst_blocks, dst_layout)
        nbytes = plan.nbytes(runs)
        self._count_staged(request_id, epoch, nbytes, "read")
        return PullResult(nbytes, 0)


def _exit_if_injected() -> None:
    """Under "exit_during_pull": exit before confirming a read (decode read the bytes, the
    pull is not done: decode must not use them)."""
    if faults.FAULT == "exit_during_pull":
        logger.error("fault injection: exiting in the middle of a one-sided KV pull")
        os._exit(17)
