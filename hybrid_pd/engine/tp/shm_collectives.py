"""All-reduce and broadcast for the ranks of one node through a shared-memory segment,
instead of gloo's loopback TCP (about 0.6-1.6 ms a collective; this takes microseconds).

One segment per group, made by rank 0 at join and mapped by the others; its name is
removed as soon as every rank mapped it, so nothing is left behind when a process dies.

```
 header (64 B) | pids: int32[size] | counters: posted[0..size), done[0..size), 64 B each
 | data: slot(parity 0, rank 0) ... slot(0, size-1) | slot(1, 0) ... slot(1, size-1)
```

Every collective is call number n on every rank (the ranks make the same calls in the same
order) and uses the slots of parity n % 2. A rank writes its slot, publishes posted = n, waits
for the posted numbers it reads, reads, then publishes done = n. Before writing the slots of
call n it waits until every rank's done reached n - 2, the last call that used them: no slot
is overwritten while a rank still reads it. The waits and publishes are `native`'s (C
atomics; a waiter spins, yields, then sleeps on a futex, and raises `PeerLost` when the rank
it waits for has died).

`all_reduce` sums the slots in rank order (((r0 + r1) + r2) + ...), bfloat16 / float16 in
float32 rounded once: the same bits on every rank, and the same sums as the gloo path.
A tensor larger than a slot goes in slot-sized chunks; an object larger than a slot is
broadcast by gloo (rank 0 says so in its slot).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import struct
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pd.engine.tp import native

SHM_DIR = Path("/dev/shm")
LINE = 64
MAGIC = 0x48504453484D3031  # "HPDSHM01"
#: Bytes of one rank's slot (per parity); env HYBRID_PD_TP_SHM_SLOT_BYTES.
DEFAULT_SLOT_BYTES = 4 << 20
#: Microseconds a waiter busy-polls, then polls yielding its core, before it sleeps on a
#: futex (env HYBRID_PD_TP_SPIN_US, HYBRID_PD_TP_YIELD_US; see docs/architecture.md).
DEFAULT_SPIN_US = 50.0
DEFAULT_YIELD_US = 200.0
#: How often a sleeping waiter checks that its peers live (ms).
CHECK_MS = 20
_TOO_LARGE = -1


class PeerLost(RuntimeError):
    """A rank this one waited for has exited: the group cannot go on."""


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    return int(text) if text else default


def _env_float(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    return float(text) if text else default


class ShmCollectives:
    """This rank's view of its group's segment. Not thread-safe: one thread of each rank
    makes the group's collectives, in the same order on every rank."""

    def __init__(self, path: Path, rank: int, size: int, slot_bytes: int, create: bool) -> None:
        lib = native.library()
        if lib is None:
            raise OSError("the shared-memory collectives' library is not available")
        self._lib = lib
        self.path, self.rank, self.size, self.slot_bytes = path, rank, size, slot_bytes
        self._pids_at = LINE
        self._counters_at = LINE + _align(4 * size, LINE)
        self._data_at = _align(self._counters_at + 2 * size * LINE, 4096)
        total = self._data_at + 2 * size * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            elif os.fstat(fd).st_size != total:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {total}")
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        if create:
            struct.pack_into("<QIQ", self._mm, 0, MAGIC, size, slot_bytes)
        elif struct.unpack_from("<QIQ", self._mm, 0) != (MAGIC, size, slot_bytes):
            raise ValueError(f"{path} is not a segment of this group")
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._base = self._bytes.data_ptr()
        struct.pack_into("<i", self._mm, self._pids_at + 4 * rank, os.getpid())
        self._pids = ctypes.cast(self._base + self._pids_at, ctypes.POINTER(ctypes.c_int32))
        self._calls = 0
        self.is_leader = rank == 0
        self.spin_us = _env_float("HYBRID_PD_TP_SPIN_US", DEFAULT_SPIN_US)
        self.yield_us = _env_float("HYBRID_PD_TP_YIELD_US", DEFAULT_YIELD_US)
        #: seconds a wait may last while its peers live (0: no deadline; an idle rank 0
        #: keeps its followers waiting for the next step as long as it likes)
        self.timeout_s = 0.0
        self._group = native.Group(
            self._counter(0, 0),
            self._counter(1, 0),
            LINE,
            size,
            rank,
            self._base + self._data_at,
            slot_bytes,
            self._base + self._pids_at,
            self.spin_us,
            self.yield_us,
            CHECK_MS,
            self.timeout_s,
        )
        self._group_ref = ctypes.byref(self._group)
        #: dtype -> the native all-reduce of a tensor that fits a slot
        self._one_call = {
            torch.float32: lib.hpd_group_all_reduce_f32,
            torch.bfloat16: lib.hpd_group_all_reduce_bf16,
        }

    @classmethod
    def create(cls, size: int, slot_bytes: int | None = None) -> ShmCollectives:
        """Rank 0's segment under a fresh name (`path`), for the others to `attach`."""
        slot = slot_bytes or _env_int("HYBRID_PD_TP_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES)
        path = SHM_DIR / f"hybrid-pd-tp-{uuid.uuid4().hex[:16]}"
        return cls(path, 0, size, _align(slot, LINE), create=True)

    @classmethod
    def attach(cls, path: str | Path, rank: int, size: int) -> ShmCollectives:
        """Map rank 0's segment as `rank`."""
        with open(path, "rb") as f:
            _, _, slot = struct.unpack("<QIQ", f.read(20))
        return cls(Path(path), rank, size, slot, create=False)

    def unlink(self) -> None:
        """Remove the segment's name (every rank has mapped it): the memory lives on until
        the last rank lets go, and nothing outlives the ranks."""
        self.path.unlink(missing_ok=True)

    def peer_pids(self) -> list[int]:
        return [self._pids[r] for r in range(self.size)]

    def close(self) -> None:
        """Let go of the mapping (where nothing else still views it)."""
        self._bytes = None
        try:
            self._mm.close()
        except BufferError:  # a tensor returned earlier still views it: freed with it
            pass

    # -- counters ------------------------------------------------------------------

    def _counter(self, kind: int, rank: int) -> int:
        """Address of posted (kind 0) or done (kind 1) of `rank`."""
        return self._base + self._counters_at + (kind * self.size + rank) * LINE

    def _wait(self, kind: int, first: int, count: int, target: int) -> None:
        got = self._lib.hpd_wait(
            self._counter(kind, first),
            count,
            LINE,
            target & 0xFFFFFFFF,
            self._base + self._pids_at + 4 * first,
            self.spin_us,
            self.yield_us,
            CHECK_MS,
            self.timeout_s,
        )
        self._check(got, first)

    def _check(self, got: int, first: int = 0) -> None:
        """Raise for a native wait's result: rank first + got - 1 died, or (< 0) timed out."""
        if got > 0:
            lost = first + got - 1
            raise PeerLost(
                f"tensor-parallel rank {lost} (pid {self._pids[lost]}) exited; rank "
                f"{self.rank} cannot finish the group's collective"
            )
        if got < 0:
            raise TimeoutError(f"tensor-parallel collective waited over {self.timeout_s} s")

    def _publish(self, kind: int, n: int) -> None:
        self._lib.hpd_publish(self._counter(kind, self.rank), n & 0xFFFFFFFF)

    def _next_call(self) -> int:
        """Number the next collective; wait until its slots are free (every rank done with
        call n - 2, the last of the same parity)."""
        self._calls += 1
        n = self._calls
        if n > 2:
            self._wait(1, 0, self.size, n - 2)
        return n

    def _slot_at(self, n: int, rank: int) -> int:
        return self._data_at + ((n % 2) * self.size + rank) * self.slot_bytes

    def _slot(self, n: int, rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        at = self._slot_at(n, rank)
        width = torch.empty((), dtype=dtype).element_size()
        return self._bytes[at : at + count * width].view(dtype)

    # -- collectives ---------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Rank-ordered sum of `x` over the ranks (see the module's docstring); a new
        tensor of `x`'s shape and dtype. Float32 and bfloat16 that fit a slot (a decode
        step's) go through one native call, no torch operation but the output's allocation;
        larger ones in slot-sized float32 chunks (bfloat16 / float16 summed in float32);
        other dtypes through torch."""
        whole = self._one_call.get(x.dtype)
        fits = x.numel() * 4 <= self.slot_bytes
        if whole is not None and fits and x.device.type == "cpu" and x.is_contiguous():
            out = torch.empty_like(x)
            self._native(whole, x, out)
            return out
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        flat = wide.contiguous().view(-1)
        out = torch.empty_like(flat)
        step = max(1, self.slot_bytes // flat.element_size())
        native_sum = flat.dtype == torch.float32 and flat.device.type == "cpu"
        for lo in range(0, max(1, flat.numel()), step):
            part = flat[lo : lo + step]
            if native_sum:
                self._native(self._lib.hpd_group_all_reduce_f32, part, out[lo : lo + part.numel()])
            else:
                self._all_reduce_torch(part, out[lo : lo + part.numel()])
        return out.view(wide.shape).to(x.dtype)

    def _native(self, fn, part: torch.Tensor, total: torch.Tensor) -> None:
        """One chunk (contiguous, at most a slot of float32), the whole collective in C."""
        self._calls += 1
        got = fn(self._group_ref, self._calls, part.data_ptr(), total.data_ptr(), part.numel())
        if got:
            self._check(got)

    def _all_reduce_torch(self, part: torch.Tensor, total: torch.Tensor) -> None:
        """One chunk: slots written, summed and released from Python."""
        k = part.numel()
        n = self._next_call()
        self._slot(n, self.rank, part.dtype, k).copy_(part)
        self._publish(0, n)
        self._wait(0, 0, self.size, n)
        torch.add(self._slot(n, 0, part.dtype, k), self._slot(n, 1, part.dtype, k), out=total)
        for r in range(2, self.size):
            total.add_(self._slot(n, r, part.dtype, k))
        self._publish(1, n)

    def gather_columns(
        self, part: torch.Tensor, columns: list[tuple[int, int]]
    ) -> torch.Tensor | None:
        """Rank 0: the [rows, total] tensor whose columns columns[r] = (lo, hi) are rank r's
        `part` ([rows, hi - lo] on every rank: the same rows and dtype); the other ranks:
        None. The others write their parts into their slots (by rows, as many calls as
        slots' worth), rank 0 copies them out; nobody adds or pads, so rank 0 gets every
        rank's bits."""
        rows = part.shape[0]
        widest = max(hi - lo for lo, hi in columns)
        per_call = max(1, self.slot_bytes // max(1, widest * part.element_size()))
        out = None
        if self.is_leader:
            out = part.new_empty((rows, columns[-1][1]))
            lo, hi = columns[0]
            out[:, lo:hi] = part
        for first in range(0, rows, per_call):
            last = min(rows, first + per_call)
            n = self._next_call()
            if not self.is_leader:
                chunk = part[first:last].reshape(-1)
                self._slot(n, self.rank, part.dtype, chunk.numel()).copy_(chunk)
                self._publish(0, n)
                self._publish(1, n)  # reads nothing: done once posted
                continue
            self._publish(0, n)  # rank 0 posts nothing; its counters keep in step
            self._wait(0, 1, self.size - 1, n)
            for r in range(1, self.size):
                lo, hi = columns[r]
                got = self._slot(n, r, part.dtype, (last - first) * (hi - lo))
                out[first:last, lo:hi] = got.view(last - first, hi - lo)
            self._publish(1, n)
        return out

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank, pickled through rank 0's slot; by gloo's
        `broadcast_object_list` when it does not fit."""
        n = self._next_call()
        at = self._slot_at(n, 0)
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            fits = len(data) + 8 <= self.slot_bytes
            struct.pack_into("<q", self._mm, at, len(data) if fits else _TOO_LARGE)
            if fits:
                self._mm[at + 8 : at + 8 + len(data)] = data
            self._publish(0, n)
            self._publish(1, n)
            if not fits:
                dist.broadcast_object_list([obj], src=0)
            return obj
        self._wait(0, 0, 1, n)
        (length,) = struct.unpack_from("<q", self._mm, at)
        data = self._mm[at + 8 : at + 8 + length] if length != _TOO_LARGE else None
        self._publish(1, n)
        if data is None:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return pickle.loads(data)
