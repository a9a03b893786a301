"""`UcxTransport`: the UCX data plane of one worker process (contract: the package docstring).

Owns the UCX context and worker, ucxx's progress thread, a notifier thread and the asyncio
event loop thread in which all UCX calls run; its public methods are blocking calls safe
from any thread but that loop's. The loop-thread work (posting, polling, settling,
draining) is `RequestPoller`'s.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import weakref
from typing import Any

import torch

from hybrid_pd.connector.ucx import cma
from hybrid_pd.connector.ucx.errors import TransferError, Unsettled
from hybrid_pd.connector.ucx.ffi import Ucx, get_ucx
from hybrid_pd.connector.ucx.iov import pack_messages
from hybrid_pd.connector.ucx.ops import Op, RecvHandle
from hybrid_pd.connector.ucx.poller import CANCEL_GRACE_S, RequestPoller
from hybrid_pd.connector.ucx.rma import MappedMemory, RemoteReads
from hybrid_pd.connector.ucx.tags import sender_key, wire_tags

logger = logging.getLogger(__name__)

_LOOP_SLACK_S = 10.0  # extra wait for the loop thread beyond an operation's own timeout

_LIVE: weakref.WeakSet[UcxTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for t in list(_LIVE):
        try:
            t.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass


class UcxTransport(RemoteReads, RequestPoller):
    """UCX data plane of one worker (see the package docstring)."""

    def __init__(
        self,
        *,
        ucx_options: dict[str, str] | None = None,
        cuda_device: int | None = None,
        drain_window_s: float = 300.0,
        epoll_timeout_ms: int = 1,
        polling: bool = False,
    ) -> None:
        self.ucx_options = dict(ucx_options or {})
        self.cuda_device = cuda_device
        self.drain_window_s = drain_window_s
        self.epoll_timeout_ms = epoll_timeout_ms
        self.polling = polling
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._notifier: threading.Thread | None = None
        self._notifier_stop = False
        self._ucx: Ucx | None = None
        self._context: Any = None
        self._worker: Any = None
        self._address: bytes = b""
        self._key = 0
        super().__init__()
        self._init_reads()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the UCX context/worker, the progress and notifier threads and the event loop
        thread. Idempotent."""
        with self._lock:
            if self._closed:
                raise TransferError("transport is closed")
            if self._started:
                return
            self._ucx = get_ucx()
            if self.cuda_device is None and torch.cuda.is_available():
                self.cuda_device = torch.cuda.current_device()
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=self._run_loop, args=(loop,), name="ucx-transport-loop", daemon=True
            )
            thread.start()
            self._loop, self._thread = loop, thread
            self._started = True
            try:
                asyncio.run_coroutine_threadsafe(self._init_async(), loop).result(60)
                ready = threading.Event()
                self._notifier = threading.Thread(
                    target=self._notifier_main,
                    args=(loop, ready),
                    name="ucx-transport-notifier",
                    daemon=True,
                )
                self._notifier.start()
                if not ready.wait(30):
                    raise TransferError("ucxx notifier thread did not start")
            except BaseException:
                self._closed = True
                self._teardown()
                raise
            _LIVE.add(self)

    async def _init_async(self) -> None:
        api = self._ucx.api
        self._context = api.UCXContext(self.ucx_options)
        self._worker = api.UCXWorker(
            self._context, enable_delayed_submission=False, enable_python_future=True
        )
        if not self._worker.enable_python_future:
            raise TransferError("this ucxx build lacks Python future support")
        if self.cuda_device is not None:
            self._worker.set_progress_thread_start_callback(
                _set_cuda_device, cb_args=(self.cuda_device,)
            )
        self._worker.start_progress_thread(
            polling_mode=self.polling, epoll_timeout=self.epoll_timeout_ms
        )
        self._address = bytes(self._worker.address.tobytes())
        self._key = sender_key(self._address)

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            asyncio.set_event_loop(None)

    def _notifier_main(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        """Moves UCX request completions onto the loop (ucxx's notifier thread, made stoppable
        per transport)."""
        api = self._ucx.api
        worker = self._worker
        asyncio.set_event_loop(loop)  # the futures pool binds futures to this thread's loop

        async def notify() -> None:
            worker.run_request_notifier()

        try:
            while not self._notifier_stop:
                worker.populate_python_futures_pool()
                ready.set()
                state = worker.wait_request_notifier(period_ns=200_000_000)
                if self._notifier_stop or state == api.PythonRequestNotifierWaitState.Shutdown:
                    break
                if state == api.PythonRequestNotifierWaitState.Timeout:
                    continue
                fut = asyncio.run_coroutine_threadsafe(notify(), loop)
                try:
                    fut.result(1.0)
                except concurrent.futures.TimeoutError:
                    pass  # leave it scheduled; cancelling would lose completions
                except Exception as e:  # pragma: no cover
                    logger.debug("ucx notifier: %s", e)
        finally:
            ready.set()
            try:
                worker.clear_python_futures_pool()
            except Exception:  # pragma: no cover
                pass

    def close(self) -> None:
        """Cancel pending operations, close endpoints, stop the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._started
        _LIVE.discard(self)
        if started:
            self._teardown()

    def _teardown(self) -> None:
        loop, thread = self._loop, self._thread
        if threading.current_thread() is thread:
            raise RuntimeError("UcxTransport.close() called from its own loop thread")
        if loop is not None and thread is not None and thread.is_alive() and self._ucx:
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown_async(), loop).result(30)
            except Exception as e:
                logger.warning("ucx transport shutdown: %s", e)
        worker = self._worker
        if worker is not None:
            self._notifier_stop = True
            try:
                worker.stop_request_notifier_thread()
            except Exception:  # pragma: no cover
                pass
            if self._notifier is not None:
                self._notifier.join(10)
            try:
                worker.stop_progress_thread()
            except Exception:  # pragma: no cover
                pass
        if loop is not None and thread is not None:
            if thread.is_alive():
                loop.call_soon_threadsafe(loop.stop)
                thread.join(10)
            if not thread.is_alive() and not loop.is_closed():
                loop.close()
        self._endpoints.clear()
        self._ops.clear()
        self._orphans.clear()
        self._worker = None
        self._context = None

    async def _shutdown_async(self) -> None:
        ops = list(self._ops) + list(self._orphans)
        for op in ops:
            self._cancel_requests(op)
        receives = [op.settled for op in ops if op.kind == "recv" and not op.settled.done()]
        if receives:  # cancelled receives settle quickly; pending sends would not
            await asyncio.wait(receives, timeout=1.0)
        for op in ops:  # what still runs is released to UCX
            self._free_requests(op, force=True)
            for f in (op.done, op.settled):
                if not f.done():
                    f.cancel()
        self._polled.clear()
        if self._poll_task is not None:
            self._poll_task.cancel()
        if self._drain_task is not None:
            self._drain_task.cancel()
        self._drain.clear()
        self._unmap_all()
        for ep in self._endpoints.values():
            try:
                ep.close_blocking(period=100_000_000, max_attempts=1)
            except Exception:  # pragma: no cover
                pass
        await asyncio.sleep(0)

    def __enter__(self) -> UcxTransport:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API ---------------------------------------------------------------------------
    @property
    def address(self) -> bytes:
        """This worker's UCX address (send it to peers over the control plane)."""
        self._check_open()
        return self._address

    @property
    def endpoint_count(self) -> int:
        return len(self._endpoints)

    def stats(self) -> dict:
        with self._stats_lock:
            s = dict(self._stats)
        s["endpoints"] = len(self._endpoints)
        s["pending_ops"] = len(self._ops)
        s["orphan_sends"] = sum(op.pending for op in list(self._orphans))
        s["drain_pending"] = len(self._drain)
        return s

    def send(self, peer: bytes, tag: int, regions: list, timeout: float) -> None:
        """Send entry i (a tensor, or a list of tensors as one scatter-gather message) as one
        message with tag `tag + i` to the worker at `peer`; blocks until all are delivered.
        Raises TransferError on failure or timeout."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking UcxTransport call from its own loop thread")
        if not regions:
            self._check_open()
            return
        self._result(self.send_future(peer, tag, regions, timeout), timeout)

    def send_future(
        self, peer: bytes, tag: int, regions: list, timeout: float
    ) -> concurrent.futures.Future:
        """`send` without blocking: the send is posted on the transport's loop and the
        returned future ends with it (TransferError on failure or timeout). An event loop
        of another thread awaits it (`asyncio.wrap_future`) with no thread in between."""
        self._check_open()
        peer = bytes(peer)
        tags = wire_tags(self._address, tag, len(regions))
        return self._submit(self._send_async(peer, tags, pack_messages(regions), timeout))

    def connect(self, peer: bytes) -> concurrent.futures.Future:
        """Make the endpoint to `peer` now, in the background, so the first send to it does
        not wait for UCX's wire-up (a peer just met at a handshake)."""
        self._check_open()
        return self._submit(self._connect_async(bytes(peer)))

    def map_memory(self, address: int, nbytes: int) -> MappedMemory:
        """Map [address, address + nbytes) of this process once for peers' one-sided reads
        (it stays mapped until `close`); its `rkey` is what a peer needs. Raises
        TransferError when UCX cannot map it."""
        self._check_open()
        return self._call(self._map_async(address, nbytes), 0.0)

    def read_future(
        self, peer: bytes, rkeys: list[bytes], rows, keep: list, timeout: float
    ) -> concurrent.futures.Future:
        """Read from the worker at `peer`, one-sided: row i of `rows` (uint64 [n, 4], the
        columns of `rma`: LOCAL, REMOTE, NBYTES, KEY) copies NBYTES bytes from the peer's
        address REMOTE, inside memory it mapped whose packed key is `rkeys[KEY]`, to this
        process's address LOCAL (inside `keep`'s tensors, kept alive while UCX may write
        them). The future ends once every byte arrived (TransferError on failure or
        timeout). The caller vouches for the addresses."""
        self._check_open()
        return self._submit(self._read_async(bytes(peer), list(rkeys), rows, keep, timeout))

    def read(self, peer: bytes, rkeys: list[bytes], rows, keep: list, timeout: float) -> None:
        """`read_future`, blocking until the bytes arrived."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking UcxTransport call from its own loop thread")
        self._result(self.read_future(peer, rkeys, rows, keep, timeout), timeout)

    def read_local(self, pid: int, rows) -> None:
        """Read `rows` (as for `read`; the KEY column unused) from process `pid` of this
        host, in the calling thread, with `process_vm_readv` rather than UCX (`cma`): a
        failure is a TransferError, where UCX's CMA read would abort this process."""
        self._check_open()
        try:
            nbytes = cma.read_process(pid, rows)
        except TransferError:
            with self._stats_lock:
                self._stats["get_failures"] += 1
            raise
        with self._stats_lock:
            self._stats["messages_read"] += len(rows)
            self._stats["bytes_read"] += nbytes

    def post_recv(self, peer: bytes, tag: int, regions: list) -> RecvHandle:
        """Post receives of messages `tag + i` from `peer` straight into `regions[i]` (a
        tensor, or a list of tensors filled in order); returns once they are posted (not
        received)."""
        self._check_open()
        peer = bytes(peer)
        tags = wire_tags(peer, tag, len(regions))
        op = self._call(self._post_recv_async(peer, tags, pack_messages(regions)), 0.0)
        return RecvHandle(self, op)

    def discard(self, peer: bytes, tag: int, count: int) -> None:
        """Drop messages `tag .. tag + count - 1` from `peer` that will never be received
        (e.g. the transfer was aborted before receives were posted), for drain_window_s."""
        self._check_open()
        tags = wire_tags(bytes(peer), tag, count)
        self._call(self._add_drain(tags), 0.0)

    def forget_peer(self, peer: bytes) -> None:
        """Close and drop the cached endpoint to `peer` (call when the control plane declares
        the peer gone). Pending sends to it are not aborted (UCX cannot, without peer error
        handling)."""
        self._check_open()
        self._call(self._forget_async(bytes(peer)), 0.0)

    # -- internals (callers' threads) ---------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transport is closed")
        if not self._started:
            raise TransferError("transport not started (call start())")

    def _call(self, coro: Any, timeout: float) -> Any:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking UcxTransport call from its own loop thread")
        return self._result(self._submit(coro), timeout)

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError as e:  # loop closed under us
            coro.close()
            raise TransferError(f"transport is closed: {e}") from e

    @staticmethod
    def _result(cf: concurrent.futures.Future, timeout: float) -> Any:
        try:
            return cf.result(timeout + CANCEL_GRACE_S + _LOOP_SLACK_S)
        except concurrent.futures.TimeoutError as e:
            cf.cancel()
            raise TransferError("UCX transport loop did not answer in time") from e
        except concurrent.futures.CancelledError as e:
            raise TransferError("transport closed during the operation") from e

    def _finish_recv(self, op: Op, timeout: float) -> BaseException | None:
        try:
            self._call(self._wait_recv_async(op, timeout), timeout)
        except Exception as e:
            return e
        return None

    def _cancel_recv(self, op: Op) -> BaseException:
        if self._closed:
            return TransferError("receive cancelled (transport closed)")
        try:
            pending = self._call(self._abort_async(op), 0.0)
        except TransferError as e:
            return e
        if pending:
            return Unsettled(
                f"{pending} receive(s) already under way did not stop within {CANCEL_GRACE_S}s"
            )
        return TransferError("receive cancelled")


def _set_cuda_device(device: int) -> None:
    """Progress-thread start callback: UCX's CUDA transports need a current context."""
    try:
        torch.cuda.set_device(device)
    except Exception as e:  # pragma: no cover - no GPU here
        logger.warning("ucx progress thread could not set CUDA device %s: %s", device, e)
