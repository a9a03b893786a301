"""UcxTransport between two real processes (UCX over shared memory / loopback only)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch

from hybrid_pd.connector import ucx

if importlib.util.find_spec("ucxx") is None:  # not imported here: UCX reads env on load
    pytest.skip("ucxx not installed", allow_module_level=True)

UcxTransport = ucx.UcxTransport
TransferError = ucx.TransferError

N_BLOCKS, PAGE = 32, 8192  # pages above UCX's 8 KiB rendezvous threshold: zero-copy path
OPTIONS = {"NET_DEVICES": "lo"}  # never a network interface other than loopback
PIPE_TIMEOUT = 20.0


def _pattern(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (N_BLOCKS, PAGE), generator=g, dtype=torch.uint8)


def _regions(pool: torch.Tensor, runs: list) -> list:
    """One tensor per (start, n) run; a list of runs is one scatter-gather message."""
    return [_regions(pool, run) if isinstance(run, list) else _run(pool, *run) for run in runs]


def _run(pool: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return pool[start : start + n]


def _peer_main(conn) -> None:
    """The other worker: a pool and a transport, driven by commands over the pipe."""
    torch.set_num_threads(1)
    pool = torch.zeros(N_BLOCKS, PAGE, dtype=torch.uint8)
    t = UcxTransport(ucx_options=OPTIONS)
    handles = {}
    try:
        t.start()
        conn.send(t.address)
        while conn.poll(60):
            cmd, *args = conn.recv()
            try:
                if cmd == "exit":
                    break
                elif cmd == "fill":
                    pool.copy_(_pattern(args[0]))
                    reply = None
                elif cmd == "post":  # peer, tag, runs
                    peer, tag, runs = args
                    handles[tag] = t.post_recv(peer, tag, _regions(pool, runs))
                    reply = None
                elif cmd == "wait":  # tag, timeout
                    handles.pop(args[0]).wait(args[1])
                    reply = None
                elif cmd == "send":  # peer, tag, runs, timeout
                    peer, tag, runs, timeout = args
                    t.send(peer, tag, _regions(pool, runs), timeout)
                    reply = None
                elif cmd == "discard":
                    t.discard(*args)
                    reply = None
                elif cmd == "map":  # the pool, for one-sided reads: (address, bytes, rkey)
                    m = t.map_memory(pool.data_ptr(), pool.numel())
                    reply = (m.address, m.nbytes, m.rkey)
                elif cmd == "pool":
                    reply = pool.clone()
                elif cmd == "stats":
                    reply = t.stats()
                else:
                    raise ValueError(cmd)
                conn.send(("ok", reply))
            except Exception as e:
                conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        t.close()
        conn.close()


class Peer:
    def __init__(self, conn, proc) -> None:
        self.conn, self.proc = conn, proc
        self.address = self._recv()

    def _recv(self, timeout: float = PIPE_TIMEOUT):
        if not self.conn.poll(timeout):
            raise TimeoutError("peer process did not answer")
        return self.conn.recv()

    def ask(self, *cmd, timeout: float = PIPE_TIMEOUT):
        self.conn.send(cmd)
        status, value = self._recv(timeout)
        if status != "ok":
            raise TransferError(value)
        return value

    def start(self, *cmd) -> None:
        self.conn.send(cmd)

    def result(self, timeout: float = PIPE_TIMEOUT):
        status, value = self._recv(timeout)
        if status != "ok":
            raise TransferError(value)
        return value


@pytest.fixture(scope="module")
def peer():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        yield Peer(parent, proc)
    finally:
        try:
            parent.send(("exit",))
        except (OSError, BrokenPipeError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent.close()


@pytest.fixture(scope="module")
def local():
    t = UcxTransport(ucx_options=OPTIONS)
    t.start()
    try:
        yield t
    finally:
        t.close()


_tags = iter(range(1 << 20, 1 << 40, 1 << 16))


def next_tag() -> int:
    return next(_tags)


def test_noncontiguous_regions_land_exactly(peer, local):
    pool = _pattern(1)
    peer.ask("fill", 0)  # zeros are not a pattern: refill with seed 0 to know the rest
    before = peer.ask("pool")
    src_runs = [(1, 2), (7, 1), (12, 5), (30, 1)]
    dst_runs = [(20, 2), (3, 1), (25, 5), (0, 1)]
    tag = next_tag()
    peer.ask("post", local.address, tag, dst_runs)
    local.send(peer.address, tag, _regions(pool, src_runs), timeout=10)
    peer.ask("wait", tag, 10)
    after = peer.ask("pool")
    expected = before.clone()
    for (s, n), (d, _) in zip(src_runs, dst_runs, strict=True):
        expected[d : d + n] = pool[s : s + n]
    assert torch.equal(after, expected)  # moved regions equal, untouched blocks unchanged
    s = local.stats()
    assert s["messages_sent"] >= 4 and s["bytes_sent"] >= 9 * PAGE


def test_scatter_gather_messages_land_exactly(peer, local):
    """Several regions per message (UCX IOV) on both sides, split differently on each:
    only each message's total bytes must agree."""
    pool = _pattern(2)
    peer.ask("fill", 0)
    before = peer.ask("pool")
    src = [[(1, 2), (7, 1)], [(12, 5)], [(30, 1), (4, 1), (9, 2)]]
    dst = [[(20, 1), (3, 2)], [(25, 4), (16, 1)], [(0, 1), (10, 3)]]
    sent = local.stats()["messages_sent"]
    tag = next_tag()
    peer.ask("post", local.address, tag, dst)
    local.send(peer.address, tag, _regions(pool, src), timeout=10)
    peer.ask("wait", tag, 10)
    after = peer.ask("pool")
    flat_src = torch.cat([pool[s : s + n] for msg in src for s, n in msg])
    flat_dst = [d + i for msg in dst for d, n in msg for i in range(n)]
    expected = before.clone()
    expected[flat_dst] = flat_src
    assert torch.equal(after, expected)
    assert local.stats()["messages_sent"] - sent == 3


def test_iov_rows_send_like_region_lists(peer, local):
    """An IovList (address, bytes rows into one pool) is the same message as the list of
    those regions."""
    pool = _pattern(3)
    peer.ask("fill", 0)
    before = peer.ask("pool")
    src = [(2, 3), (9, 1), (20, 2)]
    rows = np.array([[pool[s].data_ptr(), n * PAGE] for s, n in src], dtype=np.uint64)
    tag = next_tag()
    peer.ask("post", local.address, tag, [[(0, 2), (10, 4)]])
    local.send(peer.address, tag, [ucx.IovList(rows, pool)], timeout=10)
    peer.ask("wait", tag, 10)
    expected = before.clone()
    expected[[0, 1, 10, 11, 12, 13]] = torch.cat([pool[s : s + n] for s, n in src])
    assert torch.equal(peer.ask("pool"), expected)
    with pytest.raises(ValueError, match="uint64"):
        local.send(peer.address, tag, [ucx.IovList(rows.astype(np.int64), pool)], 1)


def test_scatter_gather_larger_than_destination_fails(peer, local):
    dst = torch.zeros(3, PAGE, dtype=torch.uint8)
    tag = next_tag()
    handle = local.post_recv(peer.address, tag, [[dst[0], dst[2]]])
    peer.ask("send", local.address, tag, [[(0, 1), (5, 1), (9, 1)]], 10)
    with pytest.raises(TransferError, match="larger"):
        handle.wait(10)
    assert torch.count_nonzero(dst[1]) == 0  # the gap between the entries is not written


def test_bidirectional_exchange(peer, local):
    mine = _pattern(2)
    peer.ask("fill", 3)
    theirs = peer.ask("pool")
    out_tag, in_tag = next_tag(), next_tag()
    # I receive their blocks 0..3 into my 10..13 while they receive my 4..7 into their 16..19
    handle = local.post_recv(peer.address, in_tag, _regions(mine, [(10, 4)]))
    peer.ask("post", local.address, out_tag, [(16, 4)])
    peer.start("send", local.address, in_tag, [(0, 4)], 10)  # runs while we send
    local.send(peer.address, out_tag, _regions(mine, [(4, 4)]), timeout=10)
    handle.wait(10)
    peer.result()
    peer.ask("wait", out_tag, 10)
    assert handle.done
    assert torch.equal(mine[10:14], theirs[0:4])
    after = peer.ask("pool")
    assert torch.equal(after[16:20], mine[4:8])
    assert torch.equal(after[:16], theirs[:16]) and torch.equal(after[20:], theirs[20:])


def test_same_tag_from_two_senders_is_matched_per_sender(peer, local):
    """UCX matches tags per worker: the transport must keep senders apart."""
    other = UcxTransport(ucx_options=OPTIONS)
    other.start()
    try:
        dst = torch.zeros(4, PAGE, dtype=torch.uint8)
        peer.ask("fill", 4)
        theirs = peer.ask("pool")
        mine = _pattern(5)
        tag = next_tag()
        h_peer = local.post_recv(peer.address, tag, [dst[0:2]])
        h_other = local.post_recv(other.address, tag, [dst[2:4]])
        other.send(local.address, tag, [mine[0:2]], timeout=10)
        peer.ask("send", local.address, tag, [(5, 2)], 10)
        h_peer.wait(10)
        h_other.wait(10)
        assert torch.equal(dst[0:2], theirs[5:7])
        assert torch.equal(dst[2:4], mine[0:2])
    finally:
        other.close()


def test_recv_timeout_raises_cancels_and_drops_late_messages(peer, local):
    dst = torch.full((3, PAGE), 7, dtype=torch.uint8)
    tag = next_tag()
    handle = local.post_recv(peer.address, tag, [dst[0:2], dst[2:3]])
    assert not handle.done
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="timed out"):
        handle.wait(0.3)
    assert time.monotonic() - t0 < 5
    assert handle.done
    handle.cancel()  # idempotent, nothing left to cancel
    with pytest.raises(TransferError):
        handle.wait(1)
    drained = local.stats()["drained"]
    # the sender shows up late: its messages are consumed and dropped, not written
    peer.ask("fill", 6)
    peer.ask("send", local.address, tag, [(0, 2), (2, 1)], 10)
    assert torch.all(dst == 7)
    # The sender completes when the data is consumed; our count is updated just after.
    deadline = time.monotonic() + 10
    while local.stats()["drained"] < drained + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert local.stats()["drained"] == drained + 2
    assert local.stats()["pending_ops"] == 0


def test_cancel_before_any_message(peer, local):
    dst = torch.zeros(2, PAGE, dtype=torch.uint8)
    handle = local.post_recv(peer.address, next_tag(), [dst])
    handle.cancel()
    assert handle.done
    with pytest.raises(TransferError, match="cancelled"):
        handle.wait(1)


def test_send_timeout_raises_and_late_discard_completes_it(peer, local):
    pool = _pattern(7)
    tag = next_tag()
    with pytest.raises(TransferError, match="timed out"):
        local.send(peer.address, tag, _regions(pool, [(0, 2)]), timeout=0.3)
    assert local.stats()["orphan_sends"] == 1  # UCX cannot cancel a started rendezvous
    peer.ask("discard", local.address, tag, 1)
    deadline = time.monotonic() + 10
    while local.stats()["orphan_sends"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert local.stats()["orphan_sends"] == 0


def test_larger_message_than_destination_fails(peer, local):
    dst = torch.zeros(1, PAGE, dtype=torch.uint8)
    tag = next_tag()
    handle = local.post_recv(peer.address, tag, [dst])
    peer.ask("send", local.address, tag, [(0, 2)], 10)
    with pytest.raises(TransferError, match="larger"):
        handle.wait(10)


def test_endpoint_cache_one_endpoint_per_peer(peer, local):
    pool = _pattern(8)
    before = local.stats()["endpoints"]
    eps = []
    for _ in range(3):
        tag = next_tag()
        peer.ask("post", local.address, tag, [(0, 1), (2, 1)])
        local.send(peer.address, tag, _regions(pool, [(0, 1), (2, 1)]), timeout=10)
        peer.ask("wait", tag, 10)
        eps.append(local._endpoints[peer.address])
    assert eps[0] is eps[1] is eps[2]
    assert local.endpoint_count == max(before, 1)
    assert list(local._endpoints).count(peer.address) == 1


def test_concurrent_callers_and_dtypes(peer, local):
    """Threads share one transport; regions of any dtype travel as their bytes."""
    src = torch.randn(8, PAGE // 4)  # float32 rows of one page
    dst = torch.zeros_like(src)
    other = UcxTransport(ucx_options=OPTIONS)
    other.start()
    errors = []

    def move(i: int) -> None:
        try:
            tag = next_tag()
            h = local.post_recv(other.address, tag, [dst[i]])
            other.send(local.address, tag, [src[i]], timeout=10)
            h.wait(10)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=move, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        assert not errors and not any(th.is_alive() for th in threads)
        assert torch.equal(src, dst)
    finally:
        other.close()


def test_lifecycle_is_idempotent():
    t = UcxTransport(ucx_options=OPTIONS)
    with pytest.raises(TransferError, match="not started"):
        _ = t.address
    t.start()
    t.start()
    address = t.address
    assert isinstance(address, bytes) and address
    t.close()
    t.close()
    with pytest.raises(TransferError, match="closed"):
        t.send(address, 0, [torch.zeros(1, dtype=torch.uint8)], 1)
    with pytest.raises(TransferError, match="closed"):
        t.start()


def test_wire_tags_keep_senders_apart():
    a, b = b"worker-a", b"worker-b"
    ta = ucx.wire_tags(a, 100, 4)
    assert len(set(ta)) == 4  # exact and one-to-one within a sender
    assert not set(ta) & set(ucx.wire_tags(b, 100, 4))
    assert ucx.wire_tags(a, 100, 4) == ta  # both sides compute the same


def test_bad_regions_and_tags_rejected(local):
    with pytest.raises(ValueError, match="contiguous"):
        local.post_recv(local.address, 0, [torch.zeros(4, 4, dtype=torch.uint8).t()])
    with pytest.raises(ValueError, match="64 bits"):
        local.send(local.address, (1 << 64) - 1, [torch.zeros(1), torch.zeros(1)], 1)
    with pytest.raises(TypeError):
        local.send(local.address, 0, [b"bytes"], 1)
    with pytest.raises(ValueError, match="at least one region"):
        local.send(local.address, 0, [[]], 1)
    with pytest.raises(ValueError, match="contiguous"):
        local.send(local.address, 0, [[torch.zeros(4, 4).t()]], 1)
