"""Same-host reads of another process's memory (`ucx.cma`): exact bytes, many pieces in
few calls, and a failure (a region gone, the process gone) is an exception, never an abort."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hybrid_pd.connector.ucx import TransferError, cma
from hybrid_pd.connector.ucx.rma import LOCAL, NBYTES, REMOTE

_CHILD = """
import ctypes, sys
n = int(sys.argv[1])
buf = (ctypes.c_uint8 * n)(*[(i * 7 + 3) % 251 for i in range(n)])
print(ctypes.addressof(buf), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child():
    """A process holding 64 KiB of a known pattern; yields (process, address, pattern)."""
    n = 64 * 1024
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        address = int(proc.stdout.readline())
        pattern = (np.arange(n, dtype=np.int64) * 7 + 3) % 251
        yield proc, address, pattern.astype(np.uint8)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _rows(dst: np.ndarray, address: int, pieces) -> np.ndarray:
    """Read rows for `pieces` ((source offset, destination offset, bytes) each)."""
    rows = np.zeros((len(pieces), 4), dtype=np.uint64)
    for i, (src_off, dst_off, n) in enumerate(pieces):
        rows[i, LOCAL] = dst.ctypes.data + dst_off
        rows[i, REMOTE] = address + src_off
        rows[i, NBYTES] = n
    return rows


def test_reads_are_exact_in_many_pieces_and_fail_cleanly(child):
    proc, address, pattern = child
    # 3000 scattered 16-byte pieces, more than one call's iovec limit, in reverse order
    dst = np.zeros(3000 * 16, dtype=np.uint8)
    pieces = [(i * 20, (2999 - i) * 16, 16) for i in range(3000)]
    assert len(pieces) > cma.IOV_MAX
    assert cma.read_process(proc.pid, _rows(dst, address, pieces)) == dst.size
    want = np.concatenate([pattern[s : s + n] for s, _, n in reversed(pieces)])
    assert np.array_equal(dst, want)
    assert cma.can_read(proc.pid, address)

    # a piece outside the owner's memory: an error (with the bytes read before it), not a
    # crash
    far = (1 << 46) - address
    with pytest.raises(TransferError, match="Bad address"):
        cma.read_process(proc.pid, _rows(dst, address, [(far, 0, 4096)]))
    with pytest.raises(TransferError, match="stopped after 16 of 4112 bytes"):
        cma.read_process(proc.pid, _rows(dst, address, [(0, 0, 16), (far, 16, 4096)]))

    proc.kill()
    proc.wait(timeout=30)
    with pytest.raises(TransferError, match="process is gone"):
        cma.read_process(proc.pid, _rows(dst, address, pieces))
    assert not cma.can_read(proc.pid, address)
    assert cma.read_process(proc.pid, np.zeros((0, 4), dtype=np.uint64)) == 0
