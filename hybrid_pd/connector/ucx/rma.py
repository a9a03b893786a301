"""One-sided reads: memory registered once, remote keys, `ucp_get_nbx` (the loop thread's
half of `UcxTransport.map_memory` / `read`).

The owner of some memory maps it once (`ucp_mem_map`) and packs a remote key for it
(`ucp_rkey_pack`); the key travels to its peers over the control plane. A peer unpacks it
once per endpoint (`ucp_ep_rkey_unpack`, cached here per peer) and reads regions of that
memory straight into its own with `ucp_get_nbx`: the owner's threads take no part (on one
host UCX reads with CMA, `process_vm_readv`; over TCP its progress thread answers). The
reads are polled like sends and receives (`poller.RequestPoller`): requests posted without
a callback, polled about every millisecond, freed once none of their batch is running.

A read cannot be cancelled in UCX: after a failure or timeout the batch gets a short grace,
then what still runs is kept alive (its destination tensors too) until UCX ends it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybrid_pd.connector.ucx.errors import TransferError
from hybrid_pd.connector.ucx.ffi import Ucx, ptr_status

_FIELD_ADDRESS_LENGTH = 0b11  # UCP_MEM_MAP_PARAM_FIELD_ADDRESS | _LENGTH
_MAP_PARAM_BYTES = 128  # > sizeof(ucp_mem_map_params_t) (48 in UCX 1.21)

#: Columns of a read's rows (uint64): destination address here, source address at the
#: peer, bytes, index of the peer's remote key.
LOCAL, REMOTE, NBYTES, KEY = range(4)

#: Rounds of worker progress without a read finishing before the loop thread leaves the
#: rest to ucxx's progress thread (`RemoteReads._progress_reads`).
READ_PROGRESS_ROUNDS = 64


class RmaCalls:
    """ctypes bindings of the libucp calls for one-sided reads (the library ucxx loaded)."""

    def __init__(self, lib: Any) -> None:
        vp, sz, u64, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int8
        sig = {
            "ucp_mem_map": ([vp, vp, vp], st),
            "ucp_mem_unmap": ([vp, vp], st),
            "ucp_rkey_pack": ([vp, vp, vp, vp], st),
            "ucp_rkey_buffer_release": ([vp], None),
            "ucp_ep_rkey_unpack": ([vp, vp, vp], st),
            "ucp_rkey_destroy": ([vp], None),
            "ucp_get_nbx": ([vp, vp, sz, u64, vp, vp], vp),
            "ucp_worker_progress": ([vp], ctypes.c_uint),
        }
        for name, (args, res) in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.mem_map, self.mem_unmap = lib.ucp_mem_map, lib.ucp_mem_unmap
        self.rkey_pack, self.rkey_buffer_release = lib.ucp_rkey_pack, lib.ucp_rkey_buffer_release
        self.rkey_unpack, self.rkey_destroy = lib.ucp_ep_rkey_unpack, lib.ucp_rkey_destroy
        self.get = lib.ucp_get_nbx
        self.progress = lib.ucp_worker_progress


@dataclass(frozen=True)
class MappedMemory:
    """Memory mapped for remote access: [address, address + nbytes) and its packed remote
    key (what a peer needs to read it)."""

    address: int
    nbytes: int
    rkey: bytes
    memh: int


def map_memory(ucx: Ucx, context_handle: int, address: int, nbytes: int) -> MappedMemory:
    """Map [address, address + nbytes) once for remote reads; raises TransferError when
    UCX cannot (no transport of this context registers memory)."""
    rma = _calls(ucx)
    params = ctypes.create_string_buffer(_MAP_PARAM_BYTES)
    ctypes.c_uint64.from_buffer(params, 0).value = _FIELD_ADDRESS_LENGTH
    ctypes.c_uint64.from_buffer(params, 8).value = address
    ctypes.c_uint64.from_buffer(params, 16).value = nbytes
    memh = ctypes.c_void_p()
    st = rma.mem_map(context_handle, params, ctypes.byref(memh))
    if st != 0:
        raise TransferError(f"ucp_mem_map of {nbytes} bytes failed: status {st}")
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    st = rma.rkey_pack(context_handle, memh, ctypes.byref(buf), ctypes.byref(size))
    if st != 0:
        rma.mem_unmap(context_handle, memh)
        raise TransferError(f"ucp_rkey_pack failed: status {st}")
    rkey = ctypes.string_at(buf, size.value)
    rma.rkey_buffer_release(buf)
    return MappedMemory(address, nbytes, rkey, memh.value)


def unmap_memory(ucx: Ucx, context_handle: int, mapped: MappedMemory) -> None:
    _calls(ucx).mem_unmap(context_handle, mapped.memh)


class RemoteKeys:
    """Unpacked remote keys, per peer (an rkey belongs to the endpoint it was unpacked on).
    Loop thread only."""

    def __init__(self, ucx_getter) -> None:
        self._ucx = ucx_getter
        self._keys: dict[bytes, dict[bytes, int]] = {}

    def get(self, peer: bytes, endpoint: int, packed: bytes) -> int:
        keys = self._keys.setdefault(peer, {})
        handle = keys.get(packed)
        if handle is None:
            out = ctypes.c_void_p()
            st = _calls(self._ucx()).rkey_unpack(endpoint, packed, ctypes.byref(out))
            if st != 0:
                raise TransferError(f"the peer's remote key does not unpack: status {st}")
            handle = keys[packed] = out.value
        return handle

    def drop(self, peer: bytes) -> None:
        """Destroy the keys of `peer` (before its endpoint closes)."""
        destroy = _calls(self._ucx()).rkey_destroy
        for handle in self._keys.pop(peer, {}).values():
            destroy(handle)

    def drop_all(self) -> None:
        for peer in list(self._keys):
            self.drop(peer)


def post_reads(ucx: Ucx, endpoint: int, rows: np.ndarray, keys: list[int], op) -> None:
    """Post one `ucp_get_nbx` per row of `rows` (columns LOCAL .. KEY) on `endpoint`,
    recording each request and status in `op`; stops at the first that fails."""
    get, param = _calls(ucx).get, ucx.ucp.param
    reqs, statuses = op.requests, op.statuses
    for local, remote, n, k in rows.tolist():
        r, st = ptr_status(get(endpoint, local, n, remote, keys[k], param))
        reqs.append(r)
        statuses.append(st)
        if st < 0:
            break


class RemoteReads:
    """The one-sided half of `UcxTransport` (a mixin over `poller.RequestPoller`, whose
    state and loop-thread methods it uses); `_read_async` runs in the loop thread."""

    _ucx: Ucx | None

    def _init_reads(self) -> None:
        self._rkeys = RemoteKeys(lambda: self._ucx)
        self._mapped: list[MappedMemory] = []

    async def _map_async(self, address: int, nbytes: int) -> MappedMemory:
        mapped = map_memory(self._ucx, self._context.handle, address, nbytes)
        self._mapped.append(mapped)
        return mapped

    async def _read_async(
        self, peer: bytes, rkeys: list[bytes], rows: np.ndarray, keep: list, timeout: float
    ) -> None:
        """Post the reads of `rows` from `peer` and wait for all; TransferError on failure
        (what still runs after a short grace is kept alive until UCX ends it)."""
        sizes = rows[:, NBYTES].tolist()
        op = self._new_op("get", peer, list(range(len(rows))), sizes, [rows, *keep])
        try:
            ep = self._endpoint(peer).handle
            keys = [self._rkeys.get(peer, ep, k) for k in rkeys]
            post_reads(self._ucx, ep, rows, keys, op)
        except Exception as e:
            await self._unposted(op)
            raise TransferError(f"UCX read failed to start: {e}") from e
        self._posted(op)
        self._progress_reads(op)
        await self._finish(op, timeout, "messages_read", "bytes_read")

    def _progress_reads(self, op) -> None:
        """Progress the worker from this (the loop) thread right after posting, so that a
        read UCX does locally (CMA: a `process_vm_readv` per piece) is copied here and now,
        not when ucxx's progress thread next wakes and gets a core, and its completion is
        seen without the poller's timer: on a loaded machine each of those hops was where
        a read's time went. The worker is in UCS_THREAD_MODE_MULTI, so progressing it from
        two threads is allowed. Stops after READ_PROGRESS_ROUNDS rounds without news (a
        read that needs the peer, over TCP): the poller then waits for it as usual."""
        progress, wh = _calls(self._ucx).progress, self._worker.handle
        idle = 0
        while op.pending and idle < READ_PROGRESS_ROUNDS:
            progress(wh)
            idle = 0 if self._poll_op(op, True) else idle + 1
        if not op.pending:
            self._polled.discard(op)

    async def _forget_async(self, peer: bytes) -> None:
        self._rkeys.drop(peer)  # keys die before their endpoint
        await super()._forget_async(peer)

    def _unmap_all(self) -> None:
        """Loop thread, at shutdown: remote keys destroyed, mappings undone."""
        self._rkeys.drop_all()
        for mapped in self._mapped:
            try:
                unmap_memory(self._ucx, self._context.handle, mapped)
            except Exception:  # pragma: no cover - best effort at shutdown
                pass
        self._mapped.clear()


def _calls(ucx: Ucx) -> RmaCalls:
    calls = getattr(ucx, "rma", None)
    if calls is None:
        calls = ucx.rma = RmaCalls(ucx.ucp.lib)
    return calls
