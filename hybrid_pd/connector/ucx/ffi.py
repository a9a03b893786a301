"""The ucxx pieces and the direct libucp calls of the bulk data path (ctypes).

`get_ucx()` imports ucxx once per process (after setting UCX_ENV_DEFAULTS where unset) and
returns a `Ucx`: ucxx's API plus `Ucp`, raw `ucp_tag_send_nbx` / `ucp_tag_recv_nbx` /
status / cancel / free on ucxx's own worker, and `RequestCanceller` for ucxx requests.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

from hybrid_pd.connector.ucx.errors import TransferError

# Defaults applied to os.environ (only where unset) before the UCX context is created.
# UCXX_LOG_LEVEL: ucxx prints its warnings on stdout, which would corrupt `--json` output.
UCX_ENV_DEFAULTS = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCXX_LOG_LEVEL": "ERROR"}


class Ucx:
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
        self.cancel = RequestCanceller()
        self.ucp = Ucp()


class RequestCanceller:
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


UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_MESSAGE_TRUNCATED = -9
UCS_ERR_CANCELED = -16
_STATUS_SPAN = 1 << 64
_UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
_UCP_DATATYPE_IOV = 2
_PARAM_DATATYPE_OFFSET = 24  # ucp_request_param_t: mask, flags, request, cb, datatype


class Ucp:
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
        self.lib = lib  # more of libucp is bound where it is used (`rma.RmaCalls`)
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


def ptr_status(v: int | None) -> tuple[int, int]:
    """(request, status) of a ucs_status_ptr_t: (0, status) when done at once."""
    if not v:
        return 0, UCS_OK
    if v >= _STATUS_SPAN - 128:  # UCS_PTR_IS_ERR: a negative status in the pointer
        return 0, v - _STATUS_SPAN
    return v, UCS_INPROGRESS


_ucx: Ucx | None = None
_ucx_lock = threading.Lock()


def get_ucx() -> Ucx:
    global _ucx
    with _ucx_lock:
        if _ucx is None:
            _apply_env_defaults()
            _ucx = Ucx()
        return _ucx


def _apply_env_defaults() -> None:
    # UCX parses these when libucs loads (first `import ucxx`); set later they only add a
    # warning of their own, so leave them alone if ucxx is already loaded.
    if "ucxx" in sys.modules:
        return
    for k, v in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
