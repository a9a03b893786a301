"""The KV pool of one tensor-parallel rank, and which bytes of a peer's pages it needs.

Every rank of a worker, and every worker serving a checkpoint whatever its TP size, keeps
the grouping planned for the whole model (TP 1): the same block size, the same groups of
the same layers, the same blocks per state. Only the slots shrink to the rank's share
(`rank_kv_config`), so block ids mean the same thing on both ends of any hand-off.

A slot is a few tensors split along their first dimension (rows), each described at TP 1
by segments of (units, rows per unit, replicated):

    attention slot  [kv_heads, 2, block_size, head_dim]   rows: KV heads (replicated)
    Mamba2 conv     [x | B | C channels, kernel - 1]      rows: heads x P | groups x N (x2)
    Mamba2 SSM      [heads, head_dim, state]              rows: heads
    GDN conv        [q | k | v channels, kernel - 1]      rows: k heads x dk (x2) | v heads x dv
    GDN recurrent   [v_heads, dk, dv]                     rows: v heads
    Mamba1 conv/SSM [inner, ...]                          rows: inner channels

A rank holds its share of each segment's units, in order (`engine.tp.shard` cuts the
weights the same way). `slot_pieces` maps a decode rank's rows to the prefill ranks that
hold them: a list of byte pieces (source rank, source offset, destination offset, bytes)
within one slot, merged where both sides are contiguous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from hybrid_pd.kvcache.config import (
    KVCacheConfig,
    align_up,
    slot_bytes_for,
    state_tensor_offsets,
)
from hybrid_pd.kvcache.specs import (
    AttentionSpec,
    LayerSpec,
    ModelCacheSpec,
    StateSpec,
    dtype_bytes,
)

#: Key of a rank config (the checkpoint config of one rank's shard) that holds the TP size
#: and the whole model's config: {"size": n, "config": {...}}.
TP_CONFIG_KEY = "hybrid_pd_tensor_parallel"

#: (units, rows per unit, replicated when fewer units than ranks)
Segment = tuple[int, int, bool]


class TPLayoutError(ValueError):
    """Two TP geometries whose pools cannot be mapped onto each other."""


def rank_kv_config(full: KVCacheConfig, rank_spec: ModelCacheSpec) -> KVCacheConfig:
    """`full` (planned for the whole model) with each group's layers given the rank's
    specs: same block size, groups, layers and blocks per state; slots of the rank's size,
    pages as large as the fullest group needs."""
    groups = []
    for g in full.groups:
        spec = rank_spec.layers[g.layer_names[0]]
        slot = slot_bytes_for(spec, full.block_size, g.blocks_per_state)
        groups.append(replace(g, spec=spec, slot_bytes=slot))
    page = align_up(max(len(g.layer_names) * g.slot_bytes for g in groups))
    return replace(full, page_size_bytes=page, groups=tuple(groups))


@dataclass(frozen=True)
class SlotRows:
    """One tensor of a slot: where it starts in the rank's slot, bytes per row, and its
    rows' segments at TP 1. `lines` > 1: the split dimension is not the first but comes
    after one that is not split (vLLM's token-major conv state, [kernel - 1, channels]):
    the tensor is `lines` back-to-back copies of the row layout, each as wide as the
    rank's rows."""

    offset: int
    row_bytes: int
    segments: tuple[Segment, ...]
    lines: int = 1

    def rank_rows(self, size: int) -> int:
        """Rows per line that each rank of a `size` group holds (every rank holds as many).
        Raises TPLayoutError when a segment does not split over `size` ranks."""
        return sum(len(rank_units(u, size, 0, rep)) * w for u, w, rep in self.segments)

    def rank_bytes(self, size: int) -> int:
        """Bytes of this tensor that each rank of a `size` group holds."""
        return self.lines * self.rank_rows(size) * self.row_bytes


def slot_rows(full: LayerSpec, rank: LayerSpec, block_size: int) -> tuple[SlotRows, ...]:
    """The row tensors of a rank's slot for a layer whose TP-1 spec is `full`. Raises
    TPLayoutError for a spec whose rows are not described."""
    if isinstance(full, AttentionSpec) and isinstance(rank, AttentionSpec):
        row = 2 * block_size * rank.head_dim * dtype_bytes(rank.dtype)
        return (SlotRows(0, row, ((full.num_kv_heads, 1, True),)),)
    if isinstance(full, StateSpec) and isinstance(rank, StateSpec) and full.row_splits:
        offsets, _ = state_tensor_offsets(rank)
        return tuple(
            SlotRows(off, math.prod(shape[1:]) * dtype_bytes(dtype), tuple(segs))
            for off, shape, dtype, segs in zip(
                offsets, rank.shapes, rank.dtypes, full.row_splits, strict=True
            )
        )
    raise TPLayoutError(f"{type(full).__name__} rows are not described for tensor parallelism")


def owner_of(
    unit: int, units: int, size: int, replicate: bool, near: int | None = None
) -> tuple[int, int]:
    """(the lowest rank of `size` holding `unit`, or rank `near` where it holds a
    replicated `unit` too; its index among that rank's units)."""
    if units % size == 0:
        per = units // size
        return unit // per, unit % per
    if replicate and size % units == 0:
        if near is not None and near * units // size == unit:
            return near, 0
        return -(-unit * size // units), 0
    raise TPLayoutError(f"{units} units do not split over {size} ranks")


def rank_units(units: int, size: int, rank: int, replicate: bool = False) -> range:
    """The units of a segment that `rank` of `size` holds, in order: an even share, or
    (`replicate`, fewer units than ranks) the one unit its heads read, r * units // size.
    Raises TPLayoutError (a ValueError) when the segment cannot be split that way."""
    if units % size == 0:
        per = units // size
        return range(rank * per, (rank + 1) * per)
    if replicate and size % units == 0:
        unit = rank * units // size
        return range(unit, unit + 1)
    raise TPLayoutError(f"{units} units do not split over {size} ranks")


#: (source rank, source byte offset in its slot, destination byte offset, bytes)
Piece = tuple[int, int, int, int]


@lru_cache(maxsize=1024)
def tensor_pieces(
    src: SlotRows,
    dst: SlotRows,
    src_size: int,
    dst_size: int,
    dst_rank: int,
    near: bool = False,
) -> tuple[Piece, ...]:
    """Byte pieces that fill rank `dst_rank`'s rows of one slot tensor from the ranks of a
    `src_size` group (each unit from the lowest source rank holding it; `near`: a
    replicated unit from source rank dst_rank * src_size // dst_size where it holds it,
    so that equal sizes pair rank with rank and a rank reads from few), merged; a tensor
    of several `lines` repeats them line by line (each side's line as wide as its rank's
    rows)."""
    if (src.segments, src.row_bytes, src.lines) != (dst.segments, dst.row_bytes, dst.lines):
        raise TPLayoutError("the two sides describe this slot tensor differently")
    src_line = src.rank_rows(src_size) * src.row_bytes
    dst_line = dst.rank_rows(dst_size) * dst.row_bytes
    prefer = dst_rank * src_size // dst_size if near else None
    pieces: list[list[int]] = []
    for line in range(src.lines):
        dst_row = 0
        src_base = [0] * src_size  # rows of earlier segments on each source rank
        for units, width, replicate in src.segments:
            for unit in rank_units(units, dst_size, dst_rank, replicate):
                rank, local = owner_of(unit, units, src_size, replicate, prefer)
                s = src.offset + line * src_line + (src_base[rank] + local * width) * src.row_bytes
                d = dst.offset + line * dst_line + dst_row * dst.row_bytes
                n = width * src.row_bytes
                last = pieces[-1] if pieces else None
                if last and last[0] == rank and last[1] + last[3] == s and last[2] + last[3] == d:
                    last[3] += n
                else:
                    pieces.append([rank, s, d, n])
                dst_row += width
            for rank in range(src_size):
                src_base[rank] += len(rank_units(units, src_size, rank, replicate)) * width
    return tuple(tuple(p) for p in pieces)  # type: ignore[misc]


def slot_pieces(
    full: LayerSpec,
    src_spec: LayerSpec,
    dst_spec: LayerSpec,
    block_size: int,
    src_size: int,
    dst_size: int,
    dst_rank: int,
) -> tuple[Piece, ...]:
    """Every piece of one slot that destination rank `dst_rank` needs (all its tensors)."""
    src_rows = slot_rows(full, src_spec, block_size)
    dst_rows = slot_rows(full, dst_spec, block_size)
    out: list[Piece] = []
    for s, d in zip(src_rows, dst_rows, strict=True):
        out += tensor_pieces(s, d, src_size, dst_size, dst_rank)
    return tuple(out)
