"""A tensor-parallel group of engine processes (ranks) on one node.

Rank 0 schedules and samples; every rank holds a shard of the weights and of the KV pool
and runs each step's forward pass with the others. Collectives go through
torch.distributed: gloo where the model lives on the CPU, NCCL on CUDA (chosen from the
device, never named by the caller); where gloo's would go over loopback TCP, the ranks
(always on one node) all-reduce and broadcast through a shared-memory segment instead
(`shm_collectives`), gloo staying for set-up and for objects too large for the segment. A
group of size 1 is the plain single-process engine: every collective returns its input
untouched.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pd.engine.tp.shm_collectives import ShmCollectives

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its worker's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    #: The node-local collectives (None: torch.distributed's); used for tensors on
    #: `shm_device` only.
    shm: ShmCollectives | None = field(default=None, compare=False, repr=False)
    shm_device: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} out of range for size {self.size}")

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that schedules, samples and answers."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, the same bits on every rank, added in rank order
        (((r0 + r1) + r2) + ...) whatever the tensor's shape. A library all-reduce splits
        the tensor into chunks whose summation order depends on the element's place: a
        token's row would then add up differently in a prompt than in a decode step, and a
        recomputed or migrated request would drift from the one decoded step by step.
        Partial sums in bfloat16 / float16 are added in float32 and rounded once."""
        if self.size == 1:
            return x
        if self.shm is not None and x.device.type == self.shm_device:
            return self.shm.all_reduce(x)
        wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x.contiguous()
        parts = [torch.empty_like(wide) for _ in range(self.size)]
        dist.all_gather(parts, wide)
        total = parts[0]
        for part in parts[1:]:
            total = total.add_(part)
        return total.to(x.dtype)

    def gather_columns(
        self, part: torch.Tensor, columns: list[tuple[int, int]]
    ) -> torch.Tensor | None:
        """Rank 0: the [rows, total] tensor whose columns columns[r] = (lo, hi) are rank
        r's `part`, bit for bit; the other ranks: None. Through shared memory where the
        group has it (the others' parts copied out of their slots), else an all-reduce of
        zero-padded parts (x + 0 is x)."""
        if self.size == 1:
            return part
        if self.shm is not None and part.device.type == self.shm_device:
            return self.shm.gather_columns(part.contiguous(), columns)
        lo, hi = columns[self.rank]
        padded = part.new_zeros((part.shape[0], columns[-1][1]))
        padded[:, lo:hi] = part
        whole = self.all_reduce(padded)
        return whole if self.is_leader else None

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; small control messages only)."""
        if self.size == 1:
            return obj
        if self.shm is not None:
            return self.shm.broadcast(obj)
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


SINGLE = TPGroup()


def backend_for(device: torch.device | str | None) -> str:
    """gloo for CPU tensors, nccl for CUDA ones."""
    kind = torch.device(device).type if device is not None else torch.get_default_device().type
    return "nccl" if kind == "cuda" else "gloo"


def open_rendezvous(size: int, host: str = "127.0.0.1", timeout_s: float = 300.0):
    """Rank 0's rendezvous store, bound now to a free port of `host` (no window in which
    another process could take the port); returns (store, "host:port") for the other
    ranks' command lines."""
    store = dist.TCPStore(
        host,
        0,
        size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, f"{host}:{store.port}"


def join_group(
    rank: int,
    size: int,
    rendezvous,
    device: torch.device | str | None = None,
    timeout_s: float = 300.0,
) -> TPGroup:
    """Join the worker's group as `rank` of `size`. `rendezvous`: rank 0's store (from
    `open_rendezvous`) on rank 0, its "host:port" on the others. Size 1 joins nothing."""
    if size == 1:
        return SINGLE
    timeout = datetime.timedelta(seconds=timeout_s)
    if isinstance(rendezvous, str):
        host, _, port = rendezvous.rpartition(":")
        store = dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
    else:
        store = rendezvous
    backend = backend_for(device)
    if backend == "gloo":
        # A worker's ranks share one node: gloo's pairs stay on loopback (unless told
        # otherwise), never on the interface the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    shm = _open_shm(rank, size, store) if backend == "gloo" else None
    logger.info(
        "tensor-parallel rank %d of %d joined (%s%s)",
        rank,
        size,
        backend,
        ", shared-memory collectives" if shm is not None else "",
    )
    kind = torch.device(device).type if device is not None else torch.get_default_device().type
    return TPGroup(rank, size, shm, kind if shm is not None else None)


def shm_enabled_by_env() -> bool:
    """HYBRID_PD_TP_SHM=0 keeps gloo's collectives (every rank must see the same value:
    followers inherit rank 0's environment)."""
    return os.environ.get("HYBRID_PD_TP_SHM", "1").strip().lower() not in ("0", "off", "no")


_SHM_KEY = "hybrid_pd/tp_shm"


def _open_shm(rank: int, size: int, store) -> ShmCollectives | None:
    """The group's shared-memory collectives, or None on every rank where any rank could
    not map the segment or see its peers' processes (then gloo's serve). Rank 0 makes the
    segment and passes its name through the rendezvous store; the name is removed once
    every rank mapped it."""
    shm = None
    try:
        if rank == 0:
            name = ""
            try:
                if shm_enabled_by_env():
                    shm = ShmCollectives.create(size)
                    name = str(shm.path)
            finally:
                store.set(_SHM_KEY, name)  # the others wait for it, whatever happened here
        else:
            name = store.get(_SHM_KEY).decode()
            if name:
                shm = ShmCollectives.attach(Path(name), rank, size)
    except (OSError, ValueError) as e:
        logger.warning("rank %d: shared-memory collectives unavailable (%s), using gloo's", rank, e)
    mapped = [False] * size
    dist.all_gather_object(mapped, shm is not None)
    if rank == 0 and shm is not None:
        shm.unlink()
    usable = all(mapped) and shm is not None and _peers_visible(shm)
    agreed = [False] * size
    dist.all_gather_object(agreed, usable)
    if all(agreed):
        return shm
    if shm is not None:
        shm.close()
    return None


def _peers_visible(shm: ShmCollectives) -> bool:
    """Whether this rank sees every peer's process (to notice its death while waiting)."""
    for pid in shm.peer_pids():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            logger.warning("tensor-parallel peer pid %d is not visible from here", pid)
            return False
        except PermissionError:
            pass
    return True


def leave_group(group: TPGroup) -> None:
    if group.shm is not None:
        group.shm.close()
    if group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
