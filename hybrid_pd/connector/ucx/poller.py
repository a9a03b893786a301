"""The loop-thread half of `UcxTransport`: post batches of UCP requests, poll them to the
end, settle them after a failure, drain late messages of cancelled receives.

Everything here runs in the transport's event loop thread only. Requests are posted with
`ucp_tag_send_nbx` / `ucp_tag_recv_nbx` (no ucxx request object per message) and polled
about every millisecond while any are in flight; they are freed only once none of their
batch is running (freeing takes the worker's spinlock, which the progress thread holds while
it copies). After a failure the batch is cancelled and given a short grace; the wire tags of
cancelled receives are drained (late messages consumed into a scratch buffer) for
`drain_window_s`, which also completes the senders' orphaned sends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hybrid_pd.connector.ucx.errors import TransferError
from hybrid_pd.connector.ucx.ffi import (
    UCS_ERR_CANCELED,
    UCS_ERR_MESSAGE_TRUNCATED,
    UCS_INPROGRESS,
    Ucx,
    ptr_status,
)
from hybrid_pd.connector.ucx.iov import Messages
from hybrid_pd.connector.ucx.ops import Op, consume
from hybrid_pd.connector.ucx.tags import TAG_SPACE

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 2.0  # how long a cancelled receive may take to settle
_SEND_CANCEL_GRACE_S = 0.1
_DRAIN_PERIOD_S = 0.05


class RequestPoller:
    """Loop-thread state and work of a `UcxTransport` (its base class). The transport sets
    `_ucx`, `_worker` (ucxx's worker), `_loop` and `drain_window_s`; the methods here run
    in `_loop`'s thread only."""

    _ucx: Ucx | None
    _worker: Any
    _loop: asyncio.AbstractEventLoop | None
    drain_window_s: float

    def __init__(self) -> None:
        self._endpoints: dict[bytes, Any] = {}
        self._ops: set[Op] = set()  # pending (not yet settled) operations
        self._orphans: set[Op] = set()  # failed sends still pending in UCX
        self._drain: dict[int, float] = {}  # wire tag -> deadline (monotonic)
        self._drain_task: asyncio.Task | None = None
        self._scratch = np.empty(64, dtype=np.uint8)
        self._polled: set[Op] = set()  # ops with requests in progress (polled)
        self._poll_task: asyncio.Task | None = None
        self._stats_lock = threading.Lock()
        self._stats = {
            "messages_sent": 0,
            "bytes_sent": 0,
            "messages_received": 0,
            "bytes_received": 0,
            "messages_read": 0,
            "bytes_read": 0,
            "send_failures": 0,
            "recv_failures": 0,
            "get_failures": 0,
            "drained": 0,
        }

    def _endpoint(self, peer: bytes) -> Any:
        ep = self._endpoints.get(peer)
        if ep is None:
            api = self._ucx.api
            address = api.UCXAddress.create_from_buffer(peer)
            ep = self._worker.create_endpoint_from_worker_address(address, False)
            self._endpoints[peer] = ep
        return ep

    async def _connect_async(self, peer: bytes) -> None:
        self._endpoint(peer)

    def _new_op(self, kind: str, peer: bytes, tags: list[int], sizes: list[int], keep: list) -> Op:
        loop = self._loop
        return Op(
            kind,
            [],
            [],
            keep,
            tags,
            sizes,
            peer,
            done=loop.create_future(),
            settled=loop.create_future(),
        )

    def _posted(self, op: Op) -> None:
        """After posting: account for what completed at once, start polling the rest."""
        statuses = op.statuses
        for i, st in enumerate(statuses):
            if st < 0:
                op.error = i
                break
        op.pending = sum(r != 0 for r in op.requests)  # posted requests are all running
        self._ops.add(op)
        self._check_done(op)
        if op.pending:
            self._polled.add(op)
            if self._poll_task is None or self._poll_task.done():
                self._poll_task = asyncio.ensure_future(self._poll_loop())

    def _check_done(self, op: Op) -> None:
        if op.pending == 0 and not op.settled.done():
            op.settled.set_result(None)
        if not op.done.done() and (op.error >= 0 or op.settled.done()):
            op.done.set_result(None)

    def _poll_op(self, op: Op, full: bool) -> bool:
        """Collect finished requests of `op` (in order up to the first one still running, or
        all with `full`). Returns whether any finished. Requests are freed only once none of
        the op's is running (`_free_requests`): `ucp_request_free` takes the worker's lock
        (a spinlock), which ucxx's progress thread holds while it copies a message, so
        freeing during a transfer spins a core against the copy."""
        check = self._ucx.ucp.check_status
        requests, statuses = op.requests, op.statuses
        progressed = False
        i, n = op.cursor, len(statuses)
        while i < n:
            if statuses[i] == UCS_INPROGRESS:
                st = check(requests[i])
                if st == UCS_INPROGRESS:
                    if not full:
                        break
                    i += 1
                    continue
                statuses[i] = st
                op.pending -= 1
                progressed = True
                if st < 0 and (op.error < 0 or i < op.error):
                    op.error = i
            if i == op.cursor:
                op.cursor = i + 1
            i += 1
        if progressed:
            if op.pending == 0:
                self._free_requests(op)
            self._check_done(op)
        return progressed

    def _free_requests(self, op: Op, force: bool = False) -> None:
        """Free the op's finished requests (`force`: running ones too; UCX then releases them
        when they finish)."""
        free = self._ucx.ucp.free
        requests, statuses = op.requests, op.statuses
        for i, r in enumerate(requests):
            if r and (force or statuses[i] != UCS_INPROGRESS):
                free(r)
                requests[i] = 0

    async def _poll_loop(self) -> None:
        """Polls the requests in flight, in order, about every millisecond (the event loop's
        timer resolution); every 50 ms all of them (failures out of order)."""
        last_full = time.monotonic()
        while self._polled:
            now = time.monotonic()
            full = now - last_full > 0.05
            if full:
                last_full = now
            for op in list(self._polled):
                self._poll_op(op, full)
                if op.pending == 0:
                    self._polled.discard(op)
                    self._orphans.discard(op)
            await asyncio.sleep(0.0005)

    async def _unposted(self, op: Op) -> None:
        """An op whose posting raised part-way: what was posted is settled (cancelled and
        freed) before the error goes up."""
        self._posted(op)
        await self._settle(op)

    async def _send_async(
        self,
        peer: bytes,
        tags: list[int],
        msgs: Messages,
        timeout: float,
    ) -> None:
        ucp = self._ucx.ucp
        op = self._new_op("send", peer, tags, msgs.sizes, msgs.keep)
        try:
            eph = self._endpoint(peer).handle
            send, params = ucp.tag_send, (ucp.param, ucp.iov_param)
            _post_each(op, tags, msgs, lambda t, p, n, iov: send(eph, p, n, t, params[iov]))
        except Exception as e:
            await self._unposted(op)
            raise TransferError(f"UCX send failed to start: {e}") from e
        self._posted(op)
        await self._finish(op, timeout, "messages_sent", "bytes_sent")

    async def _post_recv_async(self, peer: bytes, tags: list[int], msgs: Messages) -> Op:
        ucp = self._ucx.ucp
        op = self._new_op("recv", peer, tags, msgs.sizes, msgs.keep)
        try:
            wh = self._worker.handle
            recv, params, drain = ucp.tag_recv, (ucp.param, ucp.iov_param), self._drain
            full = TAG_SPACE - 1

            def post(t: int, p: int, n: int, iov: int) -> Any:
                if drain:
                    drain.pop(t, None)  # a new receive takes the tag back from draining
                return recv(wh, p, n, t, full, params[iov])

            _post_each(op, tags, msgs, post)
        except Exception as e:
            await self._unposted(op)
            raise TransferError(f"posting UCX receives failed: {e}") from e
        self._posted(op)
        if op.error >= 0:
            await self._settle(op)
            raise TransferError(f"posting UCX receives failed: status {op.statuses[op.error]}")
        return op

    async def _wait_recv_async(self, op: Op, timeout: float) -> None:
        error = await self._wait_op(op, timeout)
        if error is not None:
            await self._settle(op)
            raise error
        if op.settling is not None:  # cancelled meanwhile
            raise TransferError("receive cancelled")
        if op in self._ops:
            self._ops.discard(op)
            self._count("messages_received", len(op.wire_tags), "bytes_received", sum(op.sizes))

    async def _abort_async(self, op: Op) -> int:
        """Cancel a receive batch; returns how many requests are still running."""
        if op.settling is None and op not in self._ops:
            return 0  # already finished successfully
        if op.settling is None and op.error < 0 and op.settled.done():
            if len(op.statuses) == len(op.wire_tags):
                self._ops.discard(op)  # everything arrived before the cancel
                return 0
        return await self._settle(op)

    async def _finish(self, op: Op, timeout: float, messages: str, nbytes: str) -> None:
        """Wait for a posted send or read: on failure settle it and raise its error; else
        count its messages and bytes under the two counters named."""
        error = await self._wait_op(op, timeout)
        if error is not None:
            await self._settle(op)
            raise error
        if op in self._ops:
            self._ops.discard(op)
            self._count(messages, len(op.sizes), nbytes, sum(op.sizes))

    async def _wait_op(self, op: Op, timeout: float) -> TransferError | None:
        """None when every request succeeded within `timeout`, else the error to raise."""
        if not op.done.done():
            try:
                await asyncio.wait_for(asyncio.shield(op.done), max(timeout, 0.0))
            except TimeoutError:
                self._poll_op(op, True)
                if not op.done.done():
                    return TransferError(
                        f"UCX {op.kind} timed out after {timeout}s "
                        f"({op.pending} of {len(op.wire_tags)} messages pending)"
                    )
        if op.error >= 0:
            i, st = op.error, op.statuses[op.error]
            if st == UCS_ERR_CANCELED:
                return TransferError(f"UCX {op.kind} of message {i} cancelled")
            if st == UCS_ERR_MESSAGE_TRUNCATED:
                what = "message larger than the destination region"
            else:
                what = f"status {st}"
            return TransferError(f"UCX {op.kind} of message {i} failed: {what}")
        return None

    async def _settle(self, op: Op) -> int:
        """The cleanup after a failure, done once per batch (concurrent callers share it)."""
        if op.settling is None:
            op.settling = asyncio.ensure_future(self._settle_once(op))
        return await asyncio.shield(op.settling)

    def _cancel_requests(self, op: Op) -> None:
        if op.kind == "get":
            return  # UCX cannot cancel a one-sided read: it runs to its end
        cancel, wh = self._ucx.ucp.cancel, self._worker.handle
        for r, st in zip(op.requests, op.statuses, strict=True):
            if r and st == UCS_INPROGRESS:
                try:
                    cancel(wh, r)
                except Exception as e:  # pragma: no cover
                    logger.debug("ucx cancel: %s", e)

    async def _settle_once(self, op: Op) -> int:
        """Cancel what is pending and wait a little for it to settle; receives cancelled in
        UCX have their tags drained; what still runs is kept alive (orphans, still polled).
        Returns how many requests are still pending."""
        self._count(f"{op.kind}_failures", 1)
        self._cancel_requests(op)
        if op.pending:  # a started rendezvous send cannot be cancelled: do not wait long for it
            grace = _SEND_CANCEL_GRACE_S if op.kind == "send" else CANCEL_GRACE_S
            try:
                await asyncio.wait_for(asyncio.shield(op.settled), grace)
            except TimeoutError:
                self._poll_op(op, True)
        self._ops.discard(op)
        if op.kind == "recv":
            dropped = [
                t
                for t, st in zip(op.wire_tags, op.statuses, strict=False)
                if st == UCS_ERR_CANCELED
            ]
            dropped += op.wire_tags[len(op.statuses) :]  # never posted
            await self._add_drain(dropped)
        still = op.pending
        if still:
            self._orphans.add(op)  # the poller drops it once its requests finish
        return still

    async def _add_drain(self, tags: list[int]) -> None:
        if not tags:
            return
        deadline = time.monotonic() + self.drain_window_s
        for t in tags:
            self._drain[t] = deadline
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.ensure_future(self._drain_loop())

    async def _drain_loop(self) -> None:
        """Consume (truncated into a scratch buffer) late messages whose receives were
        cancelled; this also completes their senders' pending sends."""
        ucx = self._ucx
        while self._drain:
            now = time.monotonic()
            for t, deadline in list(self._drain.items()):
                if now > deadline:
                    del self._drain[t]
                    continue
                probe = self._worker.tag_probe(ucx.Tag(t), remove=True)
                if probe.matched:
                    del self._drain[t]
                    req = self._worker.tag_recv_with_handle(ucx.Array(self._scratch), probe)
                    w = asyncio.ensure_future(req.wait())
                    w.add_done_callback(consume)
                    self._count("drained", 1)
            await asyncio.sleep(_DRAIN_PERIOD_S)

    async def _forget_async(self, peer: bytes) -> None:
        ep = self._endpoints.pop(peer, None)
        if ep is not None:
            try:
                ep.close_blocking(period=100_000_000, max_attempts=1)
            except Exception as e:  # pragma: no cover
                logger.debug("ucx endpoint close: %s", e)

    def _count(self, *kv: Any) -> None:
        with self._stats_lock:
            for k, v in zip(kv[::2], kv[1::2], strict=True):
                self._stats[k] += v


def _post_each(op: Op, tags: list[int], msgs: Messages, post: Callable[..., Any]) -> None:
    """Posts `msgs` one message at a time, ``post(tag, ptr, count, iov)`` (a libucp call's
    return), recording each request and status in `op`; stops at the first that fails."""
    reqs, statuses = op.requests, op.statuses
    for t, p, n, iov in zip(tags, msgs.ptrs, msgs.counts, msgs.iov, strict=True):
        r, st = ptr_status(post(t, p, n, iov))
        reqs.append(r)
        statuses.append(st)
        if st < 0:
            break
