"""One-sided reads (`UcxTransport.map_memory` / `read`) between two real processes."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from hybrid_pd.connector import liveness
from hybrid_pd.connector.ucx.rma import KEY, LOCAL, NBYTES, REMOTE
from tests.connector.test_ucx_transport import (
    N_BLOCKS,
    OPTIONS,
    PAGE,
    Peer,
    TransferError,
    UcxTransport,
    _pattern,
    _peer_main,
    local,  # noqa: F401  (fixture)
    peer,  # noqa: F401  (fixture)
)


def _rows(dst: torch.Tensor, base: int, runs: list[tuple[int, int, int]]) -> np.ndarray:
    """Rows reading peer pages src .. src + n into our pages dst .. dst + n."""
    rows = np.zeros((len(runs), 4), dtype=np.uint64)
    for i, (src, d, n) in enumerate(runs):
        rows[i, LOCAL] = dst.data_ptr() + d * PAGE
        rows[i, REMOTE] = base + src * PAGE
        rows[i, NBYTES] = n * PAGE
        rows[i, KEY] = 0
    return rows


def test_read_lands_exactly_and_counts_bytes(peer, local):  # noqa: F811
    peer.ask("fill", 41)
    address, nbytes, rkey = peer.ask("map")
    assert nbytes == N_BLOCKS * PAGE and rkey
    want = _pattern(41)
    dst = torch.zeros(N_BLOCKS, PAGE, dtype=torch.uint8)
    runs = [(3, 0, 4), (20, 10, 1), (0, 31, 1), (9, 5, 2)]
    before = local.stats()["bytes_read"]
    local.read(peer.address, [rkey], _rows(dst, address, runs), [dst], 10.0)
    for src, d, n in runs:
        assert torch.equal(dst[d : d + n], want[src : src + n])
    untouched = sorted(set(range(N_BLOCKS)) - {d + i for _, d, n in runs for i in range(n)})
    assert not dst[untouched].any()  # nothing else written
    assert local.stats()["bytes_read"] - before == 8 * PAGE  # exactly the pieces asked for
    # the peer only mapped its memory: it posted nothing and sent nothing
    assert peer.ask("stats")["messages_sent"] == 0


def test_a_dead_owner_is_seen_before_any_read(local):  # noqa: F811
    """On one host UCX reads with CMA, and a CMA read of a dead process aborts the reader:
    the owner's pidfd watch says it is gone before anything is read from it."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        doomed = Peer(parent, proc)
        doomed.ask("fill", 7)
        address, _, rkey = doomed.ask("map")
        owner = liveness.watch(proc.pid, liveness.start_ticks(proc.pid))
        assert owner is not None and owner.alive()
        assert liveness.watch(proc.pid, liveness.start_ticks(proc.pid) + 1) is None  # not it
        dst = torch.zeros(4, PAGE, dtype=torch.uint8)
        local.read(doomed.address, [rkey], _rows(dst, address, [(0, 0, 4)]), [dst], 10.0)
        assert torch.equal(dst, _pattern(7)[:4])
        proc.kill()
        proc.join(10)
        assert not owner.alive()
        assert liveness.watch(proc.pid, liveness.start_ticks(proc.pid)) is None
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()


def test_map_memory_needs_a_started_transport():
    t = UcxTransport(ucx_options=OPTIONS)
    with pytest.raises(TransferError, match="not started"):
        t.map_memory(0, 1)


def test_pieces_outside_the_peers_memory_are_refused_before_any_read():
    """A piece the peer did not offer (another region, before or past one) never becomes a
    read: the plan's block ids are checked against the sizes the handshake gave."""
    from hybrid_pd.connector.onesided import RemoteMemory

    remote = RemoteMemory(
        np.array([1 << 20, 1 << 30], dtype=np.uint64),
        np.array([4 * PAGE, 2 * PAGE], dtype=np.int64),
        np.array([0, 1], dtype=np.int64),
        (b"k0", b"k1"),
    )
    dst = np.array([5000, 6000], dtype=np.uint64)
    rows = remote.rows(np.array([[0, 3 * PAGE, PAGE], [1, 0, 2 * PAGE]]), dst)
    assert rows[:, REMOTE].tolist() == [(1 << 20) + 3 * PAGE, 1 << 30]
    assert rows[:, KEY].tolist() == [0, 1] and rows[:, LOCAL].tolist() == [5000, 6000]
    assert rows[:, NBYTES].tolist() == [PAGE, 2 * PAGE]
    for bad in ([0, 3 * PAGE, 2 * PAGE], [1, -PAGE, PAGE], [2, 0, PAGE], [-1, 0, PAGE]):
        with pytest.raises(ValueError, match="outside"):
            remote.rows(np.array([bad]), dst[:1])
