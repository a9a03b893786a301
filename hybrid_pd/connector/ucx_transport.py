"""Data plane of the KV connector: tagged UCX messages between workers' KV pools (ucxx).

One `UcxTransport` per worker process. The control plane (gRPC) ships `address` (the UCX
worker address, bytes) to peers; then

    sender:    transport.send(peer_address, tag, [region_0, region_1, ...], timeout)
    receiver:  handle = transport.post_recv(peer_address, tag, [dst_0, dst_1, ...])
               ...  (tell the sender to go, over gRPC)
               handle.wait(timeout)

Entry i travels as one message with tag `tag + i`, straight from the source tensors into the
destination tensors (UCX rendezvous: the receiver reads the sender's memory with CMA on one
host, cuda_ipc between GPUs; no staging copy). An entry is a contiguous tensor of any dtype,
on CPU or CUDA, or a list of them: one scatter-gather message (UCX's IOV datatype; UCX 1.21
then has the sender write into the receiver's memory with CMA instead), so a transfer of
thousands of scattered blocks costs a few messages instead of one each. Entry i
on both sides must have the same number of bytes, however each side splits it into tensors
(a longer message fails with TransferError; a shorter one is NOT detected by UCX, so the plan
on both sides must agree; the connector derives both from the same block runs).

Threading. All UCX calls run in one asyncio event loop owned by the transport (a daemon
thread); the public methods are plain blocking calls, safe from any number of threads (gRPC
handler threads, the engine loop), but never from the transport's own loop thread. ucxx
progresses the UCX worker in its C++ progress thread (blocking mode, woken by UCX events, 1 ms
epoll timeout). The data messages bypass ucxx's request objects: the loop thread posts them
with `ucp_tag_send_nbx` / `ucp_tag_recv_nbx` on ucxx's worker and endpoints (ctypes, see
`_Ucp`) and polls their status about every millisecond while any are in flight (a ucxx
request, its Python future and its completion notice cost tens of microseconds per message,
which dominated fragmented transfers of thousands of messages). Requests are freed only once
none of their batch is running: freeing takes the worker's spinlock, which the progress
thread holds while it copies. Requests are submitted immediately, which is what makes
cancelling a posted receive safe (`ucp_request_cancel`).

Tags (the rule callers must follow). UCX matches tags per *worker*, not per endpoint: a
receive posted "on" an endpoint matches a message from any peer. So the transport mixes the
sender's identity into every wire tag: wire tag = (tag + i) XOR h(sender's worker address),
h a 64-bit hash both sides compute from the same address bytes, and matching uses the full
mask. Hence:
  * for one (sender, receiver) pair, the tags `tag .. tag + len(regions) - 1` of transfers
    that are pending at the same time must not overlap (e.g. a per-peer counter times the
    largest message count, or a random base plus a counter, as the decode connector does);
    different senders may use the same tags freely;
  * after a failed or cancelled receive, do not reuse its tags with that peer for
    `drain_window_s` (default 5 minutes): late messages with those tags are consumed and
    dropped (see "Failure" below), and would otherwise land in a new transfer.
  * tags are integers with 0 <= tag and tag + len(regions) <= 2**64.

Endpoints are made from the peer's worker address with `endpoint_error_handling=False`: with
UCX peer error handling on, UCX uses TCP between two local processes (tcp/lo, 0.6-1.3 GB/s for
64 MiB on the 2-core dev VM), while without it sysv shared memory (eager, < 8 KiB) and CMA
(rendezvous) are used (7.5-8 GB/s for 64 MiB; CUDA memory goes by cuda_ipc, checked on an
H200). The price: UCX reports no peer failure. A dead or stuck peer shows up as a timeout
here (or as an error when its shared memory is already gone) and must be detected by the
control plane (gRPC), which can then call `forget_peer`. One endpoint per peer address is
created lazily in the loop thread and cached.

Failure. On timeout or error `send` and `RecvHandle.wait` raise TransferError and cancel the
UCX requests still pending. UCX can cancel a posted receive (then its destination is no
longer written) but not a rendezvous send whose receiver has not matched it yet: such sends
stay pending in UCX (their tensors are kept alive here, counted in stats()["orphan_sends"])
until the receiver consumes or drops the message, and until then the receiver may still read
the source memory. The receiver side drops such messages: after a receive is cancelled the
transport consumes messages with those wire tags into a small scratch buffer for
`drain_window_s`, which also completes the sender's orphaned send. `discard()` does the same
for tags whose receives were never posted. A sender whose message was drained sees success:
whether a transfer counts is the control plane's call (the puller's receive is the truth).

Environment. The first `start()` in a process sets UCX_WARN_UNUSED_ENV_VARS=n unless set, and
only if ucxx is not imported yet (UCX reads it when its library loads; ucxx sets
UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows and warns about). Nothing else is needed:
with the default UCX_TLS, endpoints without error handling pick sysv/posix (eager) and CMA
(rendezvous) on one host and cuda_ipc between GPUs. `ucx_options` (UCX options without the
UCX_ prefix) override the environment for this transport only. Note that UCX also opens TCP
interfaces on every network device it finds: where only loopback may be used (tests, the
benchmark), pass {"NET_DEVICES": "lo"}.

Latency. Progress runs in blocking mode and completions are polled about every millisecond
only while requests are in flight: no core is burnt, but each send() or wait() costs up to
~1 ms (a 64 KiB message moves at ~0.1-0.2 GB/s and 1 MiB at ~2 GB/s on the 2-core dev VM).
Per message the loop thread spends a few microseconds (posting, polling); the rest is UCX's
rendezvous (RTS, CMA read, ATS) in the progress threads. `polling=True` busy-polls the UCX
worker instead (one core per worker; slower on the 2-core VM, meant for GPU servers).

CUDA. `send`/`post_recv` synchronize the caller thread's current CUDA stream of each
region's device before handing regions to UCX; data produced on another stream must be
synchronized by the caller first. The progress thread makes the CUDA device current
(`cuda_device`, default: the current device when `start()` runs).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ctypes
import hashlib
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybrid_pd.connector.base import TransferFailed

logger = logging.getLogger(__name__)

# Defaults applied to os.environ (only where unset) before the UCX context is created.
# UCXX_LOG_LEVEL: ucxx prints its warnings on stdout, which would corrupt `--json` output.
UCX_ENV_DEFAULTS = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCXX_LOG_LEVEL": "ERROR"}

TAG_SPACE = 1 << 64
_UCS_ERR_CANCELED = -16
_CANCEL_GRACE_S = 2.0  # how long a cancelled receive may take to settle
_SEND_CANCEL_GRACE_S = 0.1
_LOOP_SLACK_S = 10.0  # extra wait for the loop thread beyond an operation's own timeout
_DRAIN_PERIOD_S = 0.05


class TransferError(TransferFailed):
    """A UCX transfer failed, timed out or was cancelled (a RuntimeError)."""


def sender_key(address: bytes) -> int:
    """The 64-bit value XORed into wire tags of messages sent by the worker at `address`."""
    return int.from_bytes(hashlib.blake2b(bytes(address), digest_size=8).digest(), "little")


def wire_tags(sender_address: bytes, tag: int, count: int) -> list[int]:
    """Wire tags of `count` messages with user tags tag, tag+1, ... from `sender_address`."""
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise TypeError(f"tag must be an int, not {type(tag).__name__}")
    if tag < 0 or tag + count > TAG_SPACE:
        raise ValueError(f"tags {tag}..{tag + count - 1} do not fit in 64 bits")
    key = sender_key(sender_address)
    return [(tag + i) ^ key for i in range(count)]


# -- ucxx access ------------------------------------------------------------------------------


class _Ucx:
    """The ucxx pieces used here, imported on first start (importing ucxx sets UCX env vars)."""

    def __init__(self) -> None:
        import ucxx  # noqa: F401  (loads libucx/libucxx, sets ucxx's env defaults)
        import ucxx._lib.libucxx as api
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self.api = api
        self.Array = Array
        self.Tag = Tag
        self.TagMaskFull = TagMaskFull
        self.cancel = _RequestCanceller()
        self.ucp = _Ucp()


class _RequestCanceller:
    """Cancels one ucxx request: the Python binding (ucxx 0.52) exposes no per-request cancel,
    so call the exported C++ method `ucxx::RequestTag::cancel()` on `UCXRequest.ucxx_ptr`.

    Safe because requests are submitted at creation (delayed submission off), so the UCP
    request exists, and because only the loop thread posts receives (so a request completed
    concurrently by the progress thread cannot be confused with a new one). The worker is in
    UCS_THREAD_MODE_MULTI (ucxx always creates it so)."""

    SYMBOL = "_ZN4ucxx10RequestTag6cancelEv"

    def __init__(self) -> None:
        fn = None
        candidates = []
        try:
            import libucxx

            candidates.append(
                os.path.join(os.path.dirname(libucxx.__file__), "lib64", "libucxx.so")
            )
        except ImportError:
            pass
        candidates.append("libucxx.so")
        for path in candidates:
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
                fn = getattr(lib, self.SYMBOL)
                break
            except (OSError, AttributeError):
                continue
        if fn is None:
            raise TransferError(f"libucxx.so with {self.SYMBOL} not found; cannot cancel receives")
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = None
        self._fn = fn

    def __call__(self, request: Any) -> None:
        if not request.completed:
            self._fn(request.ucxx_ptr)


_UCS_OK = 0
_UCS_INPROGRESS = 1
_UCS_ERR_MESSAGE_TRUNCATED = -9
_STATUS_SPAN = 1 << 64
_UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
_UCP_DATATYPE_IOV = 2
_PARAM_DATATYPE_OFFSET = 24  # ucp_request_param_t: mask, flags, request, cb, datatype


class _Ucp:
    """Direct ctypes access to the libucp that ucxx loaded, for the bulk data path: one
    `ucp_tag_send_nbx` / `ucp_tag_recv_nbx` per region on ucxx's own worker and endpoints,
    without a ucxx request object, Python future and notification per message (those cost
    tens of microseconds each; a fragmented request is thousands of messages).

    Requests are posted without a callback (a zeroed `ucp_request_param_t`: contiguous
    bytes, memory type detected) and polled with `ucp_request_check_status`, then freed.
    The worker runs in UCS_THREAD_MODE_MULTI (ucxx creates it so), so posting, polling and
    cancelling from the loop thread while ucxx's progress thread progresses it is allowed."""

    PARAM_BYTES = 256  # > sizeof(ucp_request_param_t) (72 in UCX 1.21); op_attr_mask = 0

    def __init__(self) -> None:
        candidates = []
        try:
            import libucx

            candidates.append(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
        except ImportError:
            pass
        candidates.append("libucp.so")
        lib = None
        for path in candidates:
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
                break
            except OSError:
                continue
        if lib is None:
            raise TransferError("libucp.so not found")
        vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
        lib.ucp_tag_send_nbx.argtypes = [vp, vp, sz, u64, vp]
        lib.ucp_tag_send_nbx.restype = vp
        lib.ucp_tag_recv_nbx.argtypes = [vp, vp, sz, u64, u64, vp]
        lib.ucp_tag_recv_nbx.restype = vp
        lib.ucp_request_check_status.argtypes = [vp]
        lib.ucp_request_check_status.restype = ctypes.c_int8  # ucs_status_t is packed (1 byte)
        lib.ucp_request_cancel.argtypes = [vp, vp]
        lib.ucp_request_cancel.restype = None
        lib.ucp_request_free.argtypes = [vp]
        lib.ucp_request_free.restype = None
        self.tag_send = lib.ucp_tag_send_nbx
        self.tag_recv = lib.ucp_tag_recv_nbx
        self.check_status = lib.ucp_request_check_status
        self.cancel = lib.ucp_request_cancel
        self.free = lib.ucp_request_free
        self._param = ctypes.create_string_buffer(self.PARAM_BYTES)
        self.param = ctypes.addressof(self._param)
        # the same, but for a scatter-gather message: `buffer` points at `count`
        # ucp_dt_iov_t {void *buffer; size_t length} entries (datatype UCP_DATATYPE_IOV)
        self._iov_param = ctypes.create_string_buffer(self.PARAM_BYTES)
        ctypes.c_uint32.from_buffer(self._iov_param, 0).value = _UCP_OP_ATTR_FIELD_DATATYPE
        ctypes.c_uint64.from_buffer(
            self._iov_param, _PARAM_DATATYPE_OFFSET
        ).value = _UCP_DATATYPE_IOV
        self.iov_param = ctypes.addressof(self._iov_param)


def _ptr_status(v: int | None) -> tuple[int, int]:
    """(request, status) of a ucs_status_ptr_t: (0, status) when done at once."""
    if not v:
        return 0, _UCS_OK
    if v >= _STATUS_SPAN - 128:  # UCS_PTR_IS_ERR: a negative status in the pointer
        return 0, v - _STATUS_SPAN
    return v, _UCS_INPROGRESS


_ucx: _Ucx | None = None
_ucx_lock = threading.Lock()


def _get_ucx() -> _Ucx:
    global _ucx
    with _ucx_lock:
        if _ucx is None:
            _apply_env_defaults()
            _ucx = _Ucx()
        return _ucx


def _apply_env_defaults() -> None:
    # UCX parses these when libucs loads (first `import ucxx`); set later they only add a
    # warning of their own, so leave them alone if ucxx is already loaded.
    if "ucxx" in sys.modules:
        return
    for k, v in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


# -- buffers ----------------------------------------------------------------------------------


def _sync(regions: list[torch.Tensor]) -> None:
    devices = {r.device for r in regions if r.device.type == "cuda"}
    for d in devices:  # the data must be in memory before UCX reads or writes it
        torch.cuda.current_stream(d).synchronize()


def _check_region(r: Any) -> int:
    """The byte size of a region UCX may read or write in place."""
    if not isinstance(r, torch.Tensor):
        raise TypeError(f"regions must be torch tensors, not {type(r).__name__}")
    if not r.is_contiguous():
        raise ValueError("regions must be contiguous tensors")
    if r.device.type not in ("cpu", "cuda"):
        raise ValueError(f"regions on {r.device} are not supported (CPU or CUDA only)")
    return r.numel() * r.element_size()


@dataclass(frozen=True, eq=False)  # by identity: == on its array would be elementwise
class IovList:
    """One scatter-gather message given as raw entries: `iov` [n, 2] uint64 rows of (address,
    bytes) inside `owner`'s CPU memory (a tensor, or a tuple of them: the pools of a
    tensor-parallel group's ranks), which the caller vouches for (the transport keeps
    `owner` alive while UCX may touch it). Built without a tensor per entry."""

    iov: np.ndarray
    owner: torch.Tensor | tuple[torch.Tensor, ...]


@dataclass
class _Messages:
    """What the loop thread posts, one entry per message: the address and count handed to
    UCX (bytes of a contiguous region, or entries of a scatter-gather list), whether it is a
    scatter-gather list, and its bytes."""

    ptrs: list[int]
    counts: list[int]
    iov: list[bool]
    sizes: list[int]
    keep: list[Any]  # the tensors and iov arrays, alive while UCX may touch them


def _messages(regions: list[Any]) -> _Messages:
    """Message i is `regions[i]`: a contiguous CPU or CUDA tensor, or a list of them (or an
    `IovList`) moved as one scatter-gather message (UCP_DATATYPE_IOV). Synchronizes CUDA."""
    m = _Messages([], [], [], [], list(regions))
    flat: list[torch.Tensor] = []
    for r in regions:
        if isinstance(r, IovList):
            iov = r.iov
            if iov.dtype != np.uint64 or iov.ndim != 2 or iov.shape[1] != 2 or not len(iov):
                raise ValueError("an IovList needs [n >= 1, 2] uint64 (address, bytes) rows")
            owners = r.owner if isinstance(r.owner, tuple) else (r.owner,)
            if any(o.device.type != "cpu" for o in owners):
                raise ValueError("IovList entries must lie in CPU memory")
            iov = np.ascontiguousarray(iov)
        elif isinstance(r, (list, tuple)):
            if not r:
                raise ValueError("a scatter-gather message needs at least one region")
            sizes = [_check_region(part) for part in r]
            iov = np.array([(p.data_ptr(), n) for p, n in zip(r, sizes, strict=True)], np.uint64)
            flat += r
        else:
            n = _check_region(r)
            m.ptrs.append(r.data_ptr())
            m.counts.append(n)
            m.iov.append(False)
            m.sizes.append(n)
            flat.append(r)
            continue
        m.ptrs.append(iov.ctypes.data)  # a scatter-gather message: its rows
        m.counts.append(len(iov))
        m.iov.append(True)
        m.sizes.append(int(iov[:, 1].sum()))
        m.keep.append(iov)
    _sync(flat)
    return m


# -- operations -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Op:
    """One batch of raw UCP requests (polled by the loop thread) plus everything that must
    stay alive while they are pending."""

    kind: str  # "send" | "recv"
    requests: list[int]  # UCP request pointers; 0 once completed and freed (or done at once)
    statuses: list[int]  # per posted message: _UCS_INPROGRESS, _UCS_OK or an error status
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


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved


class RecvHandle:
    """Receives posted by `UcxTransport.post_recv`. Thread-safe: `cancel()` from another
    thread interrupts a `wait()`."""

    def __init__(self, transport: UcxTransport, op: _Op) -> None:
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
        if isinstance(result, _Unsettled):
            raise TransferError(str(result))


class _Unsettled(TransferError):
    pass


# -- the transport ----------------------------------------------------------------------------

_LIVE: weakref.WeakSet[UcxTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for t in list(_LIVE):
        try:
            t.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass


class UcxTransport:
    """UCX data plane of one worker (see the module docstring)."""

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
        self._ucx: _Ucx | None = None
        self._context: Any = None
        self._worker: Any = None
        self._address: bytes = b""
        self._key = 0
        # loop-thread state
        self._endpoints: dict[bytes, Any] = {}
        self._ops: set[_Op] = set()  # pending (not yet settled) operations
        self._orphans: set[_Op] = set()  # failed sends still pending in UCX
        self._drain: dict[int, float] = {}  # wire tag -> deadline (monotonic)
        self._drain_task: asyncio.Task | None = None
        self._scratch = np.empty(64, dtype=np.uint8)
        self._polled: set[_Op] = set()  # ops with requests in progress (polled)
        self._poll_task: asyncio.Task | None = None
        self._stats_lock = threading.Lock()
        self._stats = {
            "messages_sent": 0,
            "bytes_sent": 0,
            "messages_received": 0,
            "bytes_received": 0,
            "send_failures": 0,
            "recv_failures": 0,
            "drained": 0,
        }

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the UCX context/worker, the progress and notifier threads and the event loop
        thread. Idempotent."""
        with self._lock:
            if self._closed:
                raise TransferError("transport is closed")
            if self._started:
                return
            self._ucx = _get_ucx()
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
        self._check_open()
        peer = bytes(peer)
        tags = wire_tags(self._address, tag, len(regions))
        msgs = _messages(regions)
        if not regions:
            return
        self._call(self._send_async(peer, tags, msgs, timeout), timeout)

    def post_recv(self, peer: bytes, tag: int, regions: list) -> RecvHandle:
        """Post receives of messages `tag + i` from `peer` straight into `regions[i]` (a
        tensor, or a list of tensors filled in order); returns once they are posted (not
        received)."""
        self._check_open()
        peer = bytes(peer)
        tags = wire_tags(peer, tag, len(regions))
        op = self._call(self._post_recv_async(peer, tags, _messages(regions)), 0.0)
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
        loop = self._loop
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking UcxTransport call from its own loop thread")
        try:
            cf = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError as e:  # loop closed under us
            coro.close()
            raise TransferError(f"transport is closed: {e}") from e
        try:
            return cf.result(timeout + _CANCEL_GRACE_S + _LOOP_SLACK_S)
        except concurrent.futures.TimeoutError as e:
            cf.cancel()
            raise TransferError("UCX transport loop did not answer in time") from e
        except concurrent.futures.CancelledError as e:
            raise TransferError("transport closed during the operation") from e

    def _finish_recv(self, op: _Op, timeout: float) -> BaseException | None:
        try:
            self._call(self._wait_recv_async(op, timeout), timeout)
        except Exception as e:
            return e
        return None

    def _cancel_recv(self, op: _Op) -> BaseException:
        if self._closed:
            return TransferError("receive cancelled (transport closed)")
        try:
            pending = self._call(self._abort_async(op), 0.0)
        except TransferError as e:
            return e
        if pending:
            return _Unsettled(
                f"{pending} receive(s) already under way did not stop within {_CANCEL_GRACE_S}s"
            )
        return TransferError("receive cancelled")

    # -- internals (loop thread) --------------------------------------------------------------
    def _endpoint(self, peer: bytes) -> Any:
        ep = self._endpoints.get(peer)
        if ep is None:
            api = self._ucx.api
            address = api.UCXAddress.create_from_buffer(peer)
            ep = self._worker.create_endpoint_from_worker_address(address, False)
            self._endpoints[peer] = ep
        return ep

    def _new_op(self, kind: str, peer: bytes, tags: list[int], sizes: list[int], keep: list) -> _Op:
        loop = self._loop
        return _Op(
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

    def _posted(self, op: _Op) -> None:
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

    def _check_done(self, op: _Op) -> None:
        if op.pending == 0 and not op.settled.done():
            op.settled.set_result(None)
        if not op.done.done() and (op.error >= 0 or op.settled.done()):
            op.done.set_result(None)

    def _poll_op(self, op: _Op, full: bool) -> bool:
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
            if statuses[i] == _UCS_INPROGRESS:
                st = check(requests[i])
                if st == _UCS_INPROGRESS:
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

    def _free_requests(self, op: _Op, force: bool = False) -> None:
        """Free the op's finished requests (`force`: running ones too; UCX then releases them
        when they finish)."""
        free = self._ucx.ucp.free
        requests, statuses = op.requests, op.statuses
        for i, r in enumerate(requests):
            if r and (force or statuses[i] != _UCS_INPROGRESS):
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

    async def _send_async(
        self,
        peer: bytes,
        tags: list[int],
        msgs: _Messages,
        timeout: float,
    ) -> None:
        ucp = self._ucx.ucp
        op = self._new_op("send", peer, tags, msgs.sizes, msgs.keep)
        try:
            eph = self._endpoint(peer).handle
            send, params = ucp.tag_send, (ucp.param, ucp.iov_param)
            reqs, statuses = op.requests, op.statuses
            for t, p, n, iov in zip(tags, msgs.ptrs, msgs.counts, msgs.iov, strict=True):
                r, st = _ptr_status(send(eph, p, n, t, params[iov]))
                reqs.append(r)
                statuses.append(st)
                if st < 0:
                    break
        except Exception as e:
            self._posted(op)
            await self._settle(op)
            raise TransferError(f"UCX send failed to start: {e}") from e
        self._posted(op)
        error = await self._wait_op(op, timeout)
        if error is not None:
            await self._settle(op)
            raise error
        if op in self._ops:
            self._ops.discard(op)
            self._count("messages_sent", len(tags), "bytes_sent", sum(msgs.sizes))

    async def _post_recv_async(self, peer: bytes, tags: list[int], msgs: _Messages) -> _Op:
        ucp = self._ucx.ucp
        op = self._new_op("recv", peer, tags, msgs.sizes, msgs.keep)
        try:
            wh = self._worker.handle
            recv, params, drain = ucp.tag_recv, (ucp.param, ucp.iov_param), self._drain
            reqs, statuses = op.requests, op.statuses
            full = TAG_SPACE - 1
            for t, p, n, iov in zip(tags, msgs.ptrs, msgs.counts, msgs.iov, strict=True):
                if drain:
                    drain.pop(t, None)  # a new receive takes the tag back from draining
                r, st = _ptr_status(recv(wh, p, n, t, full, params[iov]))
                reqs.append(r)
                statuses.append(st)
                if st < 0:
                    break
        except Exception as e:
            self._posted(op)
            await self._settle(op)
            raise TransferError(f"posting UCX receives failed: {e}") from e
        self._posted(op)
        if op.error >= 0:
            await self._settle(op)
            raise TransferError(f"posting UCX receives failed: status {op.statuses[op.error]}")
        return op

    async def _wait_recv_async(self, op: _Op, timeout: float) -> None:
        error = await self._wait_op(op, timeout)
        if error is not None:
            await self._settle(op)
            raise error
        if op.settling is not None:  # cancelled meanwhile
            raise TransferError("receive cancelled")
        if op in self._ops:
            self._ops.discard(op)
            self._count("messages_received", len(op.wire_tags), "bytes_received", sum(op.sizes))

    async def _abort_async(self, op: _Op) -> int:
        """Cancel a receive batch; returns how many requests are still running."""
        if op.settling is None and op not in self._ops:
            return 0  # already finished successfully
        if op.settling is None and op.error < 0 and op.settled.done():
            if len(op.statuses) == len(op.wire_tags):
                self._ops.discard(op)  # everything arrived before the cancel
                return 0
        return await self._settle(op)

    async def _wait_op(self, op: _Op, timeout: float) -> TransferError | None:
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
            if st == _UCS_ERR_CANCELED:
                return TransferError(f"UCX {op.kind} of message {i} cancelled")
            if st == _UCS_ERR_MESSAGE_TRUNCATED:
                what = "message larger than the destination region"
            else:
                what = f"status {st}"
            return TransferError(f"UCX {op.kind} of message {i} failed: {what}")
        return None

    async def _settle(self, op: _Op) -> int:
        """The cleanup after a failure, done once per batch (concurrent callers share it)."""
        if op.settling is None:
            op.settling = asyncio.ensure_future(self._settle_once(op))
        return await asyncio.shield(op.settling)

    def _cancel_requests(self, op: _Op) -> None:
        cancel, wh = self._ucx.ucp.cancel, self._worker.handle
        for r, st in zip(op.requests, op.statuses, strict=True):
            if r and st == _UCS_INPROGRESS:
                try:
                    cancel(wh, r)
                except Exception as e:  # pragma: no cover
                    logger.debug("ucx cancel: %s", e)

    async def _settle_once(self, op: _Op) -> int:
        """Cancel what is pending and wait a little for it to settle; receives cancelled in
        UCX have their tags drained; what still runs is kept alive (orphans, still polled).
        Returns how many requests are still pending."""
        self._count(f"{op.kind}_failures", 1)
        self._cancel_requests(op)
        if op.pending:  # a started rendezvous send cannot be cancelled: do not wait long for it
            grace = _CANCEL_GRACE_S if op.kind == "recv" else _SEND_CANCEL_GRACE_S
            try:
                await asyncio.wait_for(asyncio.shield(op.settled), grace)
            except TimeoutError:
                self._poll_op(op, True)
        self._ops.discard(op)
        if op.kind == "recv":
            dropped = [
                t
                for t, st in zip(op.wire_tags, op.statuses, strict=False)
                if st == _UCS_ERR_CANCELED
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
                    w.add_done_callback(_consume)
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


def _set_cuda_device(device: int) -> None:
    """Progress-thread start callback: UCX's CUDA transports need a current context."""
    try:
        torch.cuda.set_device(device)
    except Exception as e:  # pragma: no cover - no GPU here
        logger.warning("ucx progress thread could not set CUDA device %s: %s", device, e)
