"""Pair source and destination blocks into contiguous runs (one UCX message per run)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


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
    pairs = []
    for g, (s, d) in enumerate(zip(src_groups, dst_groups, strict=True)):
        if len(s) != len(d):
            raise ValueError(f"group {g}: {len(s)} source blocks but {len(d)} destination")
        pairs += zip(s, d, strict=True)
    pairs.sort()
    segments: list[Segment] = []
    for s, d in pairs:
        last = segments[-1] if segments else None
        if last and s == last.src + last.length and d == last.dst + last.length:
            segments[-1] = Segment(last.src, last.dst, last.length + 1)
        else:
            segments.append(Segment(s, d, 1))
    return segments


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
