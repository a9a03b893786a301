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
    rows: Sequence[SlotRows], src_size: int, dst_size: int, dst_rank: int
) -> list[tuple[Piece, ...]]:
    """Per tensor of a layer, the pieces (source rank, source offset, destination offset,
    bytes; offsets within one block of that tensor) that fill `dst_rank`'s block (a
    replicated unit from the prefill rank nearest it: few sources per decode rank)."""
    return [tensor_pieces(r, r, src_size, dst_size, dst_rank, near=True) for r in rows]


def sources(layout_rows, src_size: int, dst_size: int, dst_rank: int) -> list[int]:
    """The prefill ranks (of `src_size`) holding a piece of `dst_rank`'s rows, in order.
    `layout_rows`: each group's SlotRows. Raises TPLayoutError for rows that do not
    split over both sizes."""
    found: set[int] = set()
    for rows in layout_rows:
        for pieces in block_pieces(rows, src_size, dst_size, dst_rank):
            found.update(p[0] for p in pieces)
    return sorted(found)


def readers(layout_rows, src_size: int, dst_size: int, src_rank: int) -> int:
    """How many decode ranks (of `dst_size`) read from prefill rank `src_rank`."""
    return sum(src_rank in sources(layout_rows, src_size, dst_size, d) for d in range(dst_size))


class RankPlan:
    """Runs between prefill rank `src_rank` of `src` and decode rank `dst_rank` of `dst`:
    an int64 [n, 4] array of (view, source offset, destination offset, bytes), offsets
    into the view's cache tensor (views numbered as `VllmPlan.memory` numbers them, the
    same on both servers: same model, same groups). `views`: this side's `VllmPlan`
    views per group, needed to read (`read_pieces`), not to count."""

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
        self._pieces: list[np.ndarray] = []  # per group: [k, 4] (tensor, src, dst, bytes)
        self._tensors: list[int] = []  # per group: tensors per layer
        for g, (a, b) in enumerate(zip(src.groups, dst.groups, strict=True)):
            if not a.rows or a.rows != b.rows:
                raise TPLayoutError(f"group {g} ({a.kind}): rows not described alike")
            per = block_pieces(a.rows, src.tp_size, dst.tp_size, dst_rank)
            found = [(j, s, d, n) for j, ps in enumerate(per) for r, s, d, n in ps if r == src_rank]
            self._pieces.append(np.asarray(found, dtype=np.int64).reshape(-1, 4))
            self._tensors.append(len(a.rows))
        counts = [g.num_layers * t for g, t in zip(dst.groups, self._tensors, strict=True)]
        #: Per group, the number of its first view.
        self._first = list(itertools.accumulate(counts, initial=0))

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
        pieces, per = self._pieces[g], self._tensors[g]
        layers = self.src.groups[g].num_layers
        # view of (layer, piece's tensor), block pair, piece
        view = self._first[g] + np.arange(layers)[:, None] * per + pieces[None, :, 0]
        rows = np.empty((layers, len(s_ids), len(pieces), 4), dtype=np.int64)
        rows[..., VIEW] = view[:, None, :]
        src_stride, dst_stride = self.src.groups[g].slot_bytes, self.dst.groups[g].slot_bytes
        rows[..., SRC_OFF] = s_ids[None, :, None] * src_stride + pieces[None, None, :, 1]
        rows[..., DST_OFF] = d_ids[None, :, None] * dst_stride + pieces[None, None, :, 2]
        rows[..., NBYTES] = pieces[None, None, :, 3]
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


def check_views(views: Sequence[Sequence], layout: KVLayout) -> None:
    """Raise TPLayoutError unless `views` (this side's `VllmPlan` views, per group) are the
    tensors `layout`'s rows describe: each group's layers' tensors, a block of each as
    large as its rows and leading with them, blocks one group page apart."""
    for g, (vs, geo) in enumerate(zip(views, layout.groups, strict=True)):
        rows = geo.rows
        if not rows or len(vs) != geo.num_layers * len(rows):
            raise TPLayoutError(f"group {g}: {len(vs)} cache tensors, rows for {len(rows)}")
        for i, v in enumerate(vs):
            r = rows[i % len(rows)]
            shape = tuple(v.t.shape[1:])
            n = r.rank_rows(layout.tp_size)
            lead = (r.lines, n) if r.lines > 1 else (n,)
            if (
                v.stride_bytes != geo.slot_bytes
                or v.block_bytes != r.rank_bytes(layout.tp_size)
                or shape[: len(lead)] != lead
            ):
                raise TPLayoutError(
                    f"group {g}: a cache tensor of {tuple(v.t.shape)} (block stride "
                    f"{v.stride_bytes} bytes) is not laid out as its rows say "
                    f"({r.rank_bytes(layout.tp_size)} bytes a block, {geo.slot_bytes} apart)"
                )
