"""Same-host one-sided reads done by the reader itself: `process_vm_readv`.

On one host UCX reads a peer's mapped memory with CMA, the same system call, but an
endpoint without peer error handling (the kind that gets shared memory and CMA) turns a
failed read into an abort of the whole reading process: a prefill worker killed during a
read took its decode worker, and every stream on it, down. Called here, the failure is an
errno: the read raises TransferError, the pull fails, and the request is retried or
recomputed like any other failed pull.

The rows are the transport's read rows (`rma.LOCAL`, `REMOTE`, `NBYTES`); the remote key
column is not used (the kernel checks access: same user, and ptrace permission).

One caveat of pids: the kernel reads whichever process holds `pid` now. The caller watches
the owner through a pidfd and discards what it read when the owner is gone by the end of
the read (a reused pid then named another process); the control plane's confirmation,
which a dead owner cannot give, is the second guard.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

from hybrid_pd.connector.ucx.errors import TransferError
from hybrid_pd.connector.ucx.rma import LOCAL, NBYTES, REMOTE

#: iovec entries per call (the kernel's UIO_MAXIOV).
IOV_MAX = 1024

_call = None


def _readv():
    global _call
    if _call is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
        ul = ctypes.c_ulong
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ul, ctypes.c_void_p, ul, ul]
        fn.restype = ctypes.c_ssize_t
        _call = fn
    return _call


def read_process(pid: int, rows: np.ndarray) -> int:
    """Copy row i's NBYTES bytes from address REMOTE of process `pid` to address LOCAL of
    this process, for every row (uint64 [n, >=3]); returns the bytes read. Raises
    TransferError when the process is gone, refuses access, or a region is not readable
    (nothing is retried: a partial read is a failure)."""
    n = len(rows)
    if n == 0:
        return 0
    local = np.empty((n, 2), dtype=np.uint64)  # struct iovec {base, len}, twice
    remote = np.empty((n, 2), dtype=np.uint64)
    local[:, 0], local[:, 1] = rows[:, LOCAL], rows[:, NBYTES]
    remote[:, 0], remote[:, 1] = rows[:, REMOTE], rows[:, NBYTES]
    sizes = rows[:, NBYTES].astype(np.int64)
    readv = _readv()
    total = 0
    for i in range(0, n, IOV_MAX):
        j = min(i + IOV_MAX, n)
        want = int(sizes[i:j].sum())
        got = readv(pid, local[i:].ctypes.data, j - i, remote[i:].ctypes.data, j - i, 0)
        if got < 0:
            code = ctypes.get_errno()
            gone = " (the process is gone)" if code == errno.ESRCH else ""
            raise TransferError(f"reading process {pid}'s memory failed: {os.strerror(code)}{gone}")
        if got != want:
            raise TransferError(
                f"reading process {pid}'s memory stopped after {total + got} of "
                f"{int(sizes.sum())} bytes (a region is no longer mapped)"
            )
        total += got
    return total


def can_read(pid: int, address: int) -> bool:
    """Whether this process may read process `pid`'s memory at `address` (one byte)."""
    dst = ctypes.create_string_buffer(1)
    rows = np.array([[ctypes.addressof(dst), address, 1]], dtype=np.uint64)
    try:
        read_process(pid, rows)
    except TransferError:
        return False
    return True
