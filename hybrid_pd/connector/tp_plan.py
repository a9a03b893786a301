"""Transfer plan between tensor-parallel groups: pools held by several ranks on each side.

Each side's rank 0 maps all its ranks' pools (the other ranks keep theirs in shared
memory), so one UCX conversation between the two rank-0 processes moves every rank's
bytes. A transfer is a list of byte pieces, the same list on both sides:

    (source rank, byte offset in that rank's pool, destination rank, byte offset, bytes)

Equal sizes pair rank r with rank r and move runs of whole pages. Different sizes move,
for every block, layer and destination rank, the pieces of the slot that rank holds
(`kvcache.tp_layout.tensor_pieces`): a KV head range, a state's head or channel rows, each
unit from one source rank (a replicated unit once per destination rank that holds it).
Consecutive pieces contiguous on both sides merge into one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.segments import plan_segments
from hybrid_pd.kvcache.tp_layout import tensor_pieces

#: Columns of a plan's rows.
SRC_RANK, SRC_OFF, DST_RANK, DST_OFF, NBYTES = range(5)


class ShardedPlan:
    """Runs are an int64 [n, 5] array of pieces (columns above). `buffers()` gives this
    side's pools, one uint8 [num_blocks, page] CPU tensor per rank, rank order."""

    def __init__(
        self, src: KVLayout, dst: KVLayout, buffers: Callable[[], Sequence[torch.Tensor]]
    ) -> None:
        if src.block_size != dst.block_size or len(src.groups) != len(dst.groups):
            raise ValueError("the two layouts do not share a grouping")
        self.src, self.dst = src, dst
        self.buffers = buffers
        self._slot_pieces: dict[tuple[int, int], np.ndarray] = {}

    @property
    def equal(self) -> bool:
        return self.src.tp_size == self.dst.tp_size

    def runs(
        self, src_groups: Sequence[Sequence[int]], dst_groups: Sequence[Sequence[int]]
    ) -> np.ndarray:
        if self.equal:
            rows = self._page_runs(src_groups, dst_groups)
        else:
            rows = self._slot_runs(src_groups, dst_groups)
        return _merge(rows)

    def _page_runs(self, src_groups, dst_groups) -> np.ndarray:
        if self.src.page_size_bytes != self.dst.page_size_bytes:
            raise ValueError("equal TP sizes with different page sizes")
        page = self.src.page_size_bytes
        segs = plan_segments(src_groups, dst_groups)
        out = np.empty((self.src.tp_size * len(segs), 5), dtype=np.int64)
        for rank in range(self.src.tp_size):
            for i, s in enumerate(segs):
                out[rank * len(segs) + i] = (
                    rank,
                    s.src * page,
                    rank,
                    s.dst * page,
                    s.length * page,
                )
        return out

    def _slot_runs(self, src_groups, dst_groups) -> np.ndarray:
        if len(src_groups) != len(dst_groups):
            raise ValueError(f"{len(src_groups)} source groups but {len(dst_groups)} destination")
        parts = []
        for d in range(self.dst.tp_size):
            for g, (s_ids, d_ids) in enumerate(zip(src_groups, dst_groups, strict=True)):
                if len(s_ids) != len(d_ids):
                    raise ValueError(
                        f"group {g}: {len(s_ids)} source blocks but {len(d_ids)} destination"
                    )
                if not len(s_ids):
                    continue
                parts.append(self._group_rows(g, d, s_ids, d_ids))
        if not parts:
            return np.empty((0, 5), dtype=np.int64)
        return np.concatenate(parts)

    def _group_rows(self, g: int, d: int, s_ids, d_ids) -> np.ndarray:
        """Rows for destination rank d and group g: block pairs x layers x slot pieces."""
        pieces = self._pieces(g, d)  # [k, 4]: src rank, src off, dst off, bytes
        sg, dg = self.src.groups[g], self.dst.groups[g]
        layers = np.arange(sg.num_layers, dtype=np.int64)
        s_base = (
            np.asarray(s_ids, np.int64)[:, None] * self.src.page_size_bytes
            + layers[None, :] * sg.slot_bytes
        ).reshape(-1)
        d_base = (
            np.asarray(d_ids, np.int64)[:, None] * self.dst.page_size_bytes
            + layers[None, :] * dg.slot_bytes
        ).reshape(-1)
        n, k = len(s_base), len(pieces)
        rows = np.empty((n, k, 5), dtype=np.int64)
        rows[:, :, SRC_RANK] = pieces[:, 0]
        rows[:, :, SRC_OFF] = s_base[:, None] + pieces[:, 1]
        rows[:, :, DST_RANK] = d
        rows[:, :, DST_OFF] = d_base[:, None] + pieces[:, 2]
        rows[:, :, NBYTES] = pieces[:, 3]
        return rows.reshape(-1, 5)

    def _pieces(self, g: int, d: int) -> np.ndarray:
        key = (g, d)
        if key not in self._slot_pieces:
            found: list = []
            for s, t in zip(self.src.groups[g].rows, self.dst.groups[g].rows, strict=True):
                found += tensor_pieces(s, t, self.src.tp_size, self.dst.tp_size, d)
            self._slot_pieces[key] = np.asarray(found, dtype=np.int64).reshape(-1, 4)
        return self._slot_pieces[key]

    # -- the TransferPlan interface ----------------------------------------------------------
    def nbytes(self, runs: np.ndarray) -> int:
        return int(runs[:, NBYTES].sum())

    def bytes_by_rank(self, runs: np.ndarray, side: str) -> list[int]:
        """Bytes each rank of `side` ("src" or "dst") sends or receives."""
        layout, col = (self.src, SRC_RANK) if side == "src" else (self.dst, DST_RANK)
        return (
            np.bincount(runs[:, col], weights=runs[:, NBYTES], minlength=layout.tp_size)
            .astype(np.int64)
            .tolist()
        )

    def iov(self, runs: np.ndarray, side: str) -> tuple[np.ndarray, tuple[torch.Tensor, ...]]:
        """(address, bytes) rows of this side's pieces and the pools they lie in. Raises
        ValueError for a piece outside its rank's pool."""
        pools = tuple(self.buffers())
        rank_col, off_col = (SRC_RANK, SRC_OFF) if side == "src" else (DST_RANK, DST_OFF)
        layout = self.src if side == "src" else self.dst
        if len(pools) != layout.tp_size:
            raise ValueError(f"{len(pools)} pools for {layout.tp_size} ranks")
        for p in pools:
            if p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError("tensor-parallel transfers need contiguous CPU pools")
        sizes = np.array([p.numel() for p in pools], dtype=np.int64)
        ranks, offs, n = runs[:, rank_col], runs[:, off_col], runs[:, NBYTES]
        if len(runs) and ((offs < 0).any() or (offs + n > sizes[ranks]).any()):
            raise ValueError("a piece lies outside its rank's pool")
        bases = np.array([p.data_ptr() for p in pools], dtype=np.uint64)
        iov = np.empty((len(runs), 2), dtype=np.uint64)
        iov[:, 0] = bases[ranks] + offs.astype(np.uint64)
        iov[:, 1] = n.astype(np.uint64)
        return iov, pools

    def memory(self) -> list[tuple[int, int]]:
        """(address, bytes) of this side's ranks' pools, rank order: the regions a one-sided
        read names by rank."""
        return [(p.data_ptr(), p.numel() * p.element_size()) for p in self.buffers()]

    def read_pieces(self, runs: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """A one-sided read of `runs`: (source rank, offset, bytes) rows at the peer, the
        destination addresses here and the pools holding them (`PagedPlan.read_pieces`)."""
        iov, pools = self.iov(runs, "dst")
        return runs[:, [SRC_RANK, SRC_OFF, NBYTES]], iov[:, 0], list(pools)

    def src_regions(self, runs: np.ndarray) -> list[torch.Tensor]:
        return self._regions(runs, SRC_RANK, SRC_OFF)

    def dst_regions(self, runs: np.ndarray) -> list[torch.Tensor]:
        return self._regions(runs, DST_RANK, DST_OFF)

    def _regions(self, runs, rank_col, off_col) -> list[torch.Tensor]:
        pools = [p.view(-1) for p in self.buffers()]
        return [pools[r][o : o + n] for r, o, n in runs[:, [rank_col, off_col, NBYTES]].tolist()]


def _merge(rows: np.ndarray) -> np.ndarray:
    """Join consecutive rows contiguous on both sides (same ranks)."""
    if len(rows) < 2:
        return rows
    prev, cur = rows[:-1], rows[1:]
    joins = (
        (prev[:, SRC_RANK] == cur[:, SRC_RANK])
        & (prev[:, DST_RANK] == cur[:, DST_RANK])
        & (prev[:, SRC_OFF] + prev[:, NBYTES] == cur[:, SRC_OFF])
        & (prev[:, DST_OFF] + prev[:, NBYTES] == cur[:, DST_OFF])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = rows[starts].copy()
    out[:, NBYTES] = np.add.reduceat(rows[:, NBYTES], starts)
    return out
