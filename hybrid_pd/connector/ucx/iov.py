"""Regions as UCX messages: contiguous tensors, scatter-gather lists (UCP_DATATYPE_IOV).

An entry is a contiguous CPU or CUDA tensor (one message of its bytes), a list of them or
an `IovList` (one scatter-gather message: UCX's IOV datatype, a few messages instead of one
per block). `pack_messages` checks the entries, builds the IOV rows and synchronizes the
CUDA streams the regions live on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def as_buffer(t: torch.Tensor) -> Any:
    """A zero-copy object ucxx accepts for the bytes of contiguous tensor `t`: a numpy uint8
    view for CPU, a uint8 tensor (exposing __cuda_array_interface__) for CUDA."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"regions must be torch tensors, not {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError("regions must be contiguous tensors")
    flat = t.detach().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return flat.numpy()
    if flat.device.type == "cuda":
        return flat
    raise ValueError(f"regions on {flat.device} are not supported (CPU or CUDA only)")


def prepare(regions: list[torch.Tensor]) -> tuple[list[Any], list[int]]:
    bufs = [as_buffer(r) for r in regions]
    sizes = [r.numel() * r.element_size() for r in regions]
    _sync(regions)
    return bufs, sizes


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
class Messages:
    """What the loop thread posts, one entry per message: the address and count handed to
    UCX (bytes of a contiguous region, or entries of a scatter-gather list), whether it is a
    scatter-gather list, and its bytes."""

    ptrs: list[int]
    counts: list[int]
    iov: list[bool]
    sizes: list[int]
    keep: list[Any]  # the tensors and iov arrays, alive while UCX may touch them


def pack_messages(regions: list[Any]) -> Messages:
    """Message i is `regions[i]`: a contiguous CPU or CUDA tensor, or a list of them (or an
    `IovList`) moved as one scatter-gather message (UCP_DATATYPE_IOV). Synchronizes CUDA."""
    m = Messages([], [], [], [], list(regions))
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
