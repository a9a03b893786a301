"""Pair source and destination blocks into contiguous runs (one UCX message per run)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
