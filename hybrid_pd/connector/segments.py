"""Pair source and destination blocks into contiguous runs (one region per run), and pack
regions into UCX messages (several regions per scatter-gather message)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from hybrid_pd.connector.ucx import IovList


@dataclass(frozen=True)
class Segment:
    src: int  # first source block id
    dst: int  # first destination block id
    length: int  # blocks


def plan_segments(
    src_groups: Sequence[Sequence[int]], dst_groups: Sequence[Sequence[int]]
) -> list[Segment]:
    """Runs where both source and destination ids are consecutive.

    Both sides compute this from the same lists, so message i of a transfer means the same
    run on both ends. Pairs are sorted by source id so runs span group boundaries.
    """
    if len(src_groups) != len(dst_groups):
        raise ValueError(f"{len(src_groups)} source groups but {len(dst_groups)} destination")
    for g, (s, d) in enumerate(zip(src_groups, dst_groups, strict=True)):
        if len(s) != len(d):
            raise ValueError(f"group {g}: {len(s)} source blocks but {len(d)} destination")
    src = np.fromiter(itertools.chain.from_iterable(src_groups), dtype=np.int64)
    dst = np.fromiter(itertools.chain.from_iterable(dst_groups), dtype=np.int64)
    order = np.lexsort((dst, src))  # by source id (then destination)
    src, dst = src[order], dst[order]
    if not len(src):
        return []
    # a run ends where either side's next id is not the next one
    ends = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(np.concatenate(([True], ends)))
    lengths = np.diff(np.append(starts, len(src)))
    return [
        Segment(a, b, n)
        for a, b, n in zip(
            src[starts].tolist(), dst[starts].tolist(), lengths.tolist(), strict=True
        )
    ]


# Packing of regions into UCX messages (one scatter-gather message carries several regions).
MESSAGE_MAX_BYTES = 256 << 20
MESSAGE_MAX_REGIONS = 1024


def pack_messages(
    sizes: Sequence[int],
    max_bytes: int = MESSAGE_MAX_BYTES,
    max_regions: int = MESSAGE_MAX_REGIONS,
) -> list[int]:
    """How many consecutive regions (of `sizes` bytes) each message carries: greedy, at most
    `max_regions` and `max_bytes` per message (a larger region travels alone)."""
    if max_regions < 1:
        raise ValueError("max_regions must be at least 1")
    counts: list[int] = []
    n = nbytes = 0
    for size in sizes:
        if n and (n == max_regions or nbytes + size > max_bytes):
            counts.append(n)
            n = nbytes = 0
        n += 1
        nbytes += size
    if n:
        counts.append(n)
    return counts


def _check_packing(counts: Sequence[int], regions: int) -> None:
    if any(c < 1 for c in counts) or sum(counts) != regions:
        raise ValueError(
            f"message packing covers {sum(counts)} regions in {len(counts)} messages, "
            f"the transfer has {regions}"
        )


def group_regions(regions: Sequence[Any], counts: Sequence[int]) -> list[Any]:
    """The transport's messages: `counts[i]` consecutive regions as one list each (a list
    of one stays a list: the receiver posted a scatter-gather message for it)."""
    _check_packing(counts, len(regions))
    out, i = [], 0
    for c in counts:
        out.append(list(regions[i : i + c]))
        i += c
    return out


def split_iov(iov: np.ndarray, owner: torch.Tensor, counts: Sequence[int]) -> list[IovList]:
    """`group_regions` for (address, bytes) rows: `counts[i]` consecutive rows per message."""
    _check_packing(counts, len(iov))
    ends = np.cumsum(counts)
    return [IovList(iov[e - c : e], owner) for c, e in zip(counts, ends.tolist(), strict=True)]


class PoolRegions:
    """`region(first, n)` over one contiguous [num_blocks, page_size_bytes] CPU or CUDA pool,
    found through `buffer()` (the engine makes its pool after the connector exists). With
    it a `PagedPlan` describes runs as (address, bytes) rows, without a tensor per run."""

    def __init__(self, buffer: Callable[[], torch.Tensor]) -> None:
        self.buffer = buffer

    def __call__(self, first: int, n: int) -> torch.Tensor:
        return self.buffer()[first : first + n]


class TransferPlan(Protocol):
    """How one side of a transfer turns block ids into the regions UCX moves.

    Both ends build the same runs from the same (source, destination) lists, in the same
    order, so region i on the sender is region i on the receiver.
    """

    def runs(
        self, src_groups: Sequence[Sequence[int]], dst_groups: Sequence[Sequence[int]]
    ) -> Sequence[Any]:
        """The runs of a transfer; raises ValueError when the lists do not pair up."""
        ...

    def src_regions(self, runs: Sequence[Any]) -> list[Any]:
        """This worker's tensors to send, one per message."""
        ...

    def dst_regions(self, runs: Sequence[Any]) -> list[Any]:
        """This worker's tensors to receive into, one per message."""
        ...

    def nbytes(self, runs: Sequence[Any]) -> int: ...


@dataclass(frozen=True)
class PagedPlan:
    """Our engine's pool: a block is one page holding every layer of its group, so a run
    of consecutive pages is one region (`region(first_block, n)`), whatever the group."""

    region: Callable[[int, int], Any]
    page_size_bytes: int

    def runs(self, src_groups, dst_groups) -> list[Segment]:
        return plan_segments(src_groups, dst_groups)

    def src_regions(self, runs: Sequence[Segment]) -> list[Any]:
        return [self.region(s.src, s.length) for s in runs]

    def dst_regions(self, runs: Sequence[Segment]) -> list[Any]:
        return [self.region(s.dst, s.length) for s in runs]

    def nbytes(self, runs: Sequence[Segment]) -> int:
        return sum(s.length for s in runs) * self.page_size_bytes

    def memory(self) -> list[tuple[int, int]] | None:
        """(address, bytes) of the regions a one-sided read may name: the pool (None
        unless it is one contiguous CPU pool, `PoolRegions`)."""
        pool = self._pool()
        return None if pool is None else [(pool.data_ptr(), pool.numel() * pool.element_size())]

    def read_pieces(self, runs: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray, list]:
        """A one-sided read of `runs` from a peer whose pool is region 0: int64 [n, 3]
        (region, byte offset, bytes) there, the uint64 [n] destination addresses here, and
        what holds them. Raises ValueError when this pool is not readable so or a block
        lies outside it."""
        found = self.iov(runs, "dst")
        if found is None:
            raise ValueError("this pool takes no one-sided reads")
        iov, pool = found
        page = self.page_size_bytes
        pieces = np.zeros((len(runs), 3), dtype=np.int64)
        pieces[:, 1] = [s.src * page for s in runs]
        pieces[:, 2] = iov[:, 1].astype(np.int64)
        return pieces, iov[:, 0], [pool]

    def _pool(self) -> torch.Tensor | None:
        if not isinstance(self.region, PoolRegions):
            return None
        pool = self.region.buffer()
        if (
            pool.device.type != "cpu"
            or pool.dim() != 2
            or not pool.is_contiguous()
            or pool.shape[1] * pool.element_size() != self.page_size_bytes
        ):
            return None
        return pool

    def iov(self, runs: Sequence[Segment], side: str) -> tuple[np.ndarray, torch.Tensor] | None:
        """(address, bytes) rows of this side's runs ("src" or "dst") and the pool they lie
        in; None unless the regions come from one contiguous CPU pool (`PoolRegions`).
        Raises ValueError for block ids outside the pool."""
        pool = self._pool()
        if pool is None:
            return None
        page = self.page_size_bytes
        first = np.fromiter((s.src if side == "src" else s.dst for s in runs), np.int64, len(runs))
        length = np.fromiter((s.length for s in runs), np.int64, len(runs))
        if len(runs) and (first.min() < 0 or (first + length).max() > pool.shape[0]):
            raise ValueError(f"block ids outside the pool of {pool.shape[0]} blocks")
        iov = np.empty((len(runs), 2), dtype=np.uint64)
        iov[:, 0] = pool.data_ptr() + first * page
        iov[:, 1] = length * page
        return iov, pool
