"""Transfers between vLLM servers of different tensor-parallel sizes: one decode rank's
pieces from one prefill rank.

Each rank of a vLLM server is its own process, so a decode rank reads its rows itself,
one-sided, from every prefill rank that holds a piece of them (`sources`), one read per
prefill rank, and confirms each with that rank (PullKV read_done, `dst_rank`):

    prefill TP 1 ─► decode TP 2     decode rank d reads its heads / channels from rank 0
    prefill TP 2 ─► decode TP 1     decode rank 0 reads rank 0's rows and rank 1's rows

The pieces within a block are `kvcache.tp_layout.tensor_pieces` of the two sides'
`SlotRows` (`tp_rows`): a head range of an attention block, a conv state's x, B and C
channels per tap, a state's head rows; each piece lies at the same offset in every
block, so a run of blocks is the pieces shifted by each side's block stride (the group's
page size: vLLM views every layer's cache over pages of its group's size). A plan serves
both ends: decode reads with it (`read_pieces`), the prefill rank counts with it what
was read from it (`nbytes`), and how many decode ranks read from it (`readers`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.kvcache.tp_layout import Piece, SlotRows, TPLayoutError, tensor_pieces

#: Columns of a plan's runs.
VIEW, SRC_OFF, DST_OFF, NBYTES = range(4)


def block_pieces(
    src_rows: Sequence[SlotRows],
    dst_rows: Sequence[SlotRows],
    src_size: int,
    dst_size: int,
    dst_rank: int,
) -> list[Piece]:
    """The pieces (source rank, source offset, destination offset, bytes; offsets within
    one block of a layer's cache, each side's tensors at their own offsets) that fill
    `dst_rank`'s block (a replicated unit from the prefill rank nearest it: few sources
    per decode rank)."""
    out: list[Piece] = []
    for s, d in zip(src_rows, dst_rows, strict=True):
        out += tensor_pieces(s, d, src_size, dst_size, dst_rank, near=True)
    return out


def sources(layout_rows, src_size: int, dst_size: int, dst_rank: int) -> list[int]:
    """The prefill ranks (of `src_size`) holding a piece of `dst_rank`'s rows, in order.
    `layout_rows`: each group's SlotRows. Raises TPLayoutError for rows that do not
    split over both sizes."""
    found: set[int] = set()
    for rows in layout_rows:
        found.update(p[0] for p in block_pieces(rows, rows, src_size, dst_size, dst_rank))
    return sorted(found)


def readers(layout_rows, src_size: int, dst_size: int, src_rank: int) -> int:
    """How many decode ranks (of `dst_size`) read from prefill rank `src_rank`."""
    return sum(src_rank in sources(layout_rows, src_size, dst_size, d) for d in range(dst_size))


def unread(layout_rows, src_size: int, dst_size: int, dst_rank: int) -> list[int]:
    """The prefill ranks no decode rank reads from (they hold only replicated rows that
    other ranks serve) that decode rank `dst_rank` releases: each by the decode rank
    p * dst_size // src_size, so that exactly one does."""
    return [
        p
        for p in range(src_size)
        if p * dst_size // src_size == dst_rank and readers(layout_rows, src_size, dst_size, p) == 0
    ]


class RankPlan:
    """Runs between prefill rank `src_rank` of `src` and decode rank `dst_rank` of `dst`:
    an int64 [n, 4] array of (view, source offset, destination offset, bytes), offsets
    into the view's cache tensor (views numbered as `VllmPlan.memory` numbers them, the
    same on both servers: same model, same groups; one view per layer, holding the
    layer's tensors at their rows' offsets). `views`: this side's `VllmPlan` views per
    group, needed to read (`read_pieces`), not to count."""

    def __init__(
        self,
        src: KVLayout,
        dst: KVLayout,
        src_rank: int,
        dst_rank: int,
        views: Sequence[Sequence] | None = None,
    ) -> None:
        if src.block_size != dst.block_size or len(src.groups) != len(dst.groups):
            raise TPLayoutError("the two layouts do not share a grouping")
        self.src, self.dst = src, dst
        self.src_rank, self.dst_rank = src_rank, dst_rank
        self.views = views
        self._pieces: list[np.ndarray] = []  # per group: [k, 3] (src, dst, bytes)
        for g, (a, b) in enumerate(zip(src.groups, dst.groups, strict=True)):
            if not a.rows or row_shapes(a.rows) != row_shapes(b.rows):
                raise TPLayoutError(f"group {g} ({a.kind}): rows not described alike")
            per = block_pieces(a.rows, b.rows, src.tp_size, dst.tp_size, dst_rank)
            found = [(s, d, n) for r, s, d, n in per if r == src_rank]
            self._pieces.append(np.asarray(found, dtype=np.int64).reshape(-1, 3))
        #: Per group, the number of its first view.
        self._first = list(itertools.accumulate((g.num_layers for g in dst.groups), initial=0))

    @property
    def pull_fields(self) -> dict:
        """What a PullKV for these pieces says besides the blocks: whose pieces they are."""
        return {"per_rank": True, "dst_rank": self.dst_rank}

    @property
    def readers(self) -> int:
        """How many decode ranks read from this plan's prefill rank (its lease ends at
        their last Release)."""
        rows = [g.rows for g in self.src.groups]
        return readers(rows, self.src.tp_size, self.dst.tp_size, self.src_rank)

    def runs(self, src_groups, dst_groups) -> np.ndarray:
        """The pieces of the blocks paired (from the end, as `VllmPlan.runs` pairs them:
        decode may hold a prefix) per group. Raises ValueError when decode wants more
        blocks than were kept."""
        if len(src_groups) != len(self.src.groups) or len(dst_groups) != len(self.src.groups):
            raise ValueError(
                f"{len(src_groups)} source and {len(dst_groups)} destination groups, "
                f"the layout has {len(self.src.groups)}"
            )
        parts = []
        for g, (s_ids, d_ids) in enumerate(zip(src_groups, dst_groups, strict=True)):
            if len(d_ids) > len(s_ids):
                raise ValueError(f"group {g}: {len(d_ids)} blocks wanted, {len(s_ids)} kept")
            if not len(d_ids) or not len(self._pieces[g]):
                continue
            s_ids = np.asarray(list(s_ids)[len(s_ids) - len(d_ids) :], dtype=np.int64)
            d_ids = np.asarray(list(d_ids), dtype=np.int64)
            parts.append(self._group_runs(g, s_ids, d_ids))
        if not parts:
            return np.empty((0, 4), dtype=np.int64)
        return np.concatenate(parts)

    def _group_runs(self, g: int, s_ids: np.ndarray, d_ids: np.ndarray) -> np.ndarray:
        pieces = self._pieces[g]
        layers = self.src.groups[g].num_layers
        # layer (its view), block pair, piece
        rows = np.empty((layers, len(s_ids), len(pieces), 4), dtype=np.int64)
        rows[..., VIEW] = self._first[g] + np.arange(layers)[:, None, None]
        src_stride, dst_stride = self.src.groups[g].slot_bytes, self.dst.groups[g].slot_bytes
        rows[..., SRC_OFF] = s_ids[None, :, None] * src_stride + pieces[None, None, :, 0]
        rows[..., DST_OFF] = d_ids[None, :, None] * dst_stride + pieces[None, None, :, 1]
        rows[..., NBYTES] = pieces[None, None, :, 2]
        return rows.reshape(-1, 4)

    def nbytes(self, runs: np.ndarray) -> int:
        return int(runs[:, NBYTES].sum()) if len(runs) else 0

    def read_pieces(self, runs: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """A one-sided read of `runs` (as `VllmPlan.read_pieces`): (view, offset, bytes)
        rows at the prefill rank, this rank's destination addresses, and the tensors
        holding them. Raises ValueError for a piece outside this rank's cache."""
        if self.views is None:
            raise ValueError("this plan counts pieces; it has no cache to read into")
        flat = [v for vs in self.views for v in vs]
        spans = np.array([v.span for v in flat], dtype=np.int64)
        bases = np.array([v.t.data_ptr() for v in flat], dtype=np.uint64)
        k, off, n = runs[:, VIEW], runs[:, DST_OFF], runs[:, NBYTES]
        if len(runs) and ((k >= len(flat)).any() or (off < 0).any() or (off + n > spans[k]).any()):
            raise ValueError("a piece lies outside this rank's cache")
        local = bases[k] + off.astype(np.uint64)
        return runs[:, [VIEW, SRC_OFF, NBYTES]], local, [v.t for v in flat]


def row_shapes(rows: Sequence[SlotRows]) -> list[tuple]:
    """What two TP sizes' descriptions of a layer's tensors must share (not the offsets:
    each rank packs its own, smaller or larger, tensors)."""
    return [(r.segments, r.row_bytes, r.lines) for r in rows]


def check_views(views: Sequence[Sequence], layout: KVLayout) -> None:
    """Raise TPLayoutError unless `views` (this side's `VllmPlan` views, per group) are the
    caches `layout`'s rows describe: one view per layer, a block of it holding the
    layer's tensors packed at their rows' offsets (an attention block leading with its
    KV heads), blocks one group page apart."""
    for g, (vs, geo) in enumerate(zip(views, layout.groups, strict=True)):
        rows, tp = geo.rows, layout.tp_size
        if not rows or len(vs) != geo.num_layers:
            raise TPLayoutError(f"group {g}: {len(vs)} cache tensors for {geo.num_layers} layers")
        ends = [r.offset + r.rank_bytes(tp) for r in rows]
        packed = [r.offset for r in rows] == [0, *ends[:-1]]
        for v in vs:
            lead = tuple(v.t.shape[1:2])
            if (
                not packed
                or v.stride_bytes != geo.slot_bytes
                or v.block_bytes != ends[-1]
                or (len(rows) == 1 and rows[0].lines == 1 and lead != (rows[0].rank_rows(tp),))
            ):
                raise TPLayoutError(
                    f"group {g}: a cache tensor of {tuple(v.t.shape)} (block stride "
                    f"{v.stride_bytes} bytes) is not laid out as its rows say "
                    f"({ends[-1]} bytes a block, {geo.slot_bytes} apart)"
                )
