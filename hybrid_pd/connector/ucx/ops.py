"""A batch of UCP requests (`Op`) and the handle a receiver holds on one (`RecvHandle`)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybrid_pd.connector.ucx.errors import TransferError, Unsettled

if TYPE_CHECKING:
    from hybrid_pd.connector.ucx.transport import UcxTransport


@dataclass(eq=False)
class Op:
    """One batch of raw UCP requests (polled by the loop thread) plus everything that must
    stay alive while they are pending."""

    kind: str  # "send" | "recv" | "get" (one-sided reads)
    requests: list[int]  # UCP request pointers; 0 once completed and freed (or done at once)
    statuses: list[int]  # per posted message: UCS_INPROGRESS, UCS_OK or an error status
    keepalive: list[Any]
    wire_tags: list[int]
    sizes: list[int]
    peer: bytes = b""
    pending: int = 0  # requests still in progress
    cursor: int = 0  # messages before it are known complete
    error: int = -1  # index of the first message that failed (-1: none yet)
    done: asyncio.Future | None = None  # set when all completed or one failed
    settled: asyncio.Future | None = None  # set when nothing is in progress any more
    settling: asyncio.Task | None = field(default=None)  # the one cleanup after a failure


def consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved


class RecvHandle:
    """Receives posted by `UcxTransport.post_recv`. Thread-safe: `cancel()` from another
    thread interrupts a `wait()`."""

    def __init__(self, transport: UcxTransport, op: Op) -> None:
        self._transport = transport
        self._op = op
        self._lock = threading.Lock()
        self._result: BaseException | None = None
        self._finished = False

    @property
    def done(self) -> bool:
        """True once every message arrived, or the handle failed or was cancelled."""
        op = self._op
        return self._finished or (op.pending == 0 and len(op.statuses) == len(op.wire_tags))

    @property
    def nbytes(self) -> int:
        return sum(self._op.sizes)

    def _set(self, result: BaseException | None) -> BaseException | None:
        with self._lock:
            if not self._finished:
                self._finished, self._result = True, result
            return self._result

    def wait(self, timeout: float) -> None:
        """Block until all messages arrived. Raises TransferError on failure or timeout (the
        receives still pending are then cancelled: their destinations are no longer written,
        except by a message already being copied, which is waited for briefly)."""
        if not self._finished:
            self._set(self._transport._finish_recv(self._op, timeout))
        if self._result is not None:
            raise TransferError(str(self._result)) from self._result

    def cancel(self) -> None:
        """Cancel what is still pending (idempotent; a no-op once `wait()` returned). Raises
        TransferError only if a message already being copied did not finish within a few
        seconds (its destination may then still be written)."""
        if self._finished:
            return
        result = self._set(self._transport._cancel_recv(self._op))
        if isinstance(result, Unsettled):
            raise TransferError(str(result))
