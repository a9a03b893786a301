"""The transfer plan over vLLM's per-layer caches: runs of blocks as memory regions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class Run:
    group: int
    src: int
    dst: int
    length: int


class _View:
    """One cache tensor of one layer, indexed by block id first."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        per_block = t[0]
        if not per_block.is_contiguous():
            raise ValueError(f"a block of a {tuple(t.shape)} cache tensor is not contiguous")
        self.runs_contiguous = t.stride(0) == per_block.numel()
        self.block_bytes = per_block.numel() * per_block.element_size()
        self.stride_bytes = t.stride(0) * t.element_size()

    @property
    def span(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        return (self.t.shape[0] - 1) * self.stride_bytes + self.block_bytes

    def regions(self, first: int, n: int) -> list[torch.Tensor]:
        if self.runs_contiguous:
            return [self.t[first : first + n]]
        return [self.t[b] for b in range(first, first + n)]


def _block_views(t: torch.Tensor, num_blocks: int, layer: str) -> list[_View]:
    """`t` seen as tensors whose first dimension is the block id (e.g. K and V of a
    (2, num_blocks, ...) attention cache; conv and SSM state come as separate tensors)."""
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise ValueError(f"{layer}: no dimension of {tuple(t.shape)} has {num_blocks} blocks")
    lead = t.shape[: dims[0]]
    return [_View(t[idx]) for idx in itertools.product(*map(range, lead))] if lead else [_View(t)]


class VllmPlan:
    """TransferPlan over vLLM's per-layer caches: a run of consecutive blocks of one group
    is one region per layer and per block-indexed tensor of that layer.

    Runs pair each group's source and destination blocks from the end: when decode already
    holds a prefix (its prefix cache), only the blocks it lacks move."""

    def __init__(self, kv_cache_config: KVCacheConfig, kv_caches: dict[str, Any]) -> None:
        self.views: list[list[_View]] = []
        for g in kv_cache_config.transfer_groups:
            views: list[_View] = []
            for name in g.layer_names:
                cache = kv_caches[name]
                tensors = list(cache) if isinstance(cache, (list, tuple)) else [cache]
                for t in tensors:
                    views += _block_views(t, kv_cache_config.num_blocks, name)
            self.views.append(views)

    def runs(self, src_groups, dst_groups) -> list[Run]:
        if len(src_groups) != len(self.views) or len(dst_groups) != len(self.views):
            raise ValueError(
                f"{len(src_groups)} source and {len(dst_groups)} destination groups, "
                f"this cache has {len(self.views)}"
            )
        runs: list[Run] = []
        for g, (src, dst) in enumerate(zip(src_groups, dst_groups, strict=True)):
            if len(dst) > len(src):
                raise ValueError(f"group {g}: {len(dst)} blocks wanted, {len(src)} kept")
            pairs = zip(list(src)[len(src) - len(dst) :], dst, strict=True)
            for s, d in pairs:
                last = runs[-1] if runs and runs[-1].group == g else None
                if last and s == last.src + last.length and d == last.dst + last.length:
                    runs[-1] = Run(g, last.src, last.dst, last.length + 1)
                else:
                    runs.append(Run(g, s, d, 1))
        return runs

    def _regions(self, runs: Sequence[Run], side: str) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for r in runs:
            first = r.src if side == "src" else r.dst
            for v in self.views[r.group]:
                out += v.regions(first, r.length)
        return out

    def src_regions(self, runs: Sequence[Run]) -> list[torch.Tensor]:
        return self._regions(runs, "src")

    def dst_regions(self, runs: Sequence[Run]) -> list[torch.Tensor]:
        return self._regions(runs, "dst")

    def memory(self) -> list[tuple[int, int]] | None:
        """(address, bytes) of every block-indexed cache tensor, groups in order: the
        regions a one-sided read names (None unless all lie in CPU memory)."""
        out = []
        for views in self.views:
            for v in views:
                if v.t.device.type != "cpu":
                    return None
                out.append((v.t.data_ptr(), v.span))
        return out

    def read_pieces(self, runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray, list]:
        """A one-sided read of `runs`: (region, offset, bytes) rows at the peer (regions as
        in `memory`), this side's destination addresses, in `dst_regions`' order, and the
        tensors holding them. Raises ValueError for a block outside this cache."""
        first = list(itertools.accumulate((len(v) for v in self.views), initial=0))
        pieces, dst = [], []
        for r in runs:
            for j, v in enumerate(self.views[r.group]):
                if r.dst < 0 or r.dst + r.length > v.t.shape[0]:
                    raise ValueError(f"blocks {r.dst}..{r.dst + r.length} outside the cache")
                base, k = v.t.data_ptr(), first[r.group] + j
                if v.runs_contiguous:
                    pieces.append((k, r.src * v.stride_bytes, r.length * v.block_bytes))
                    dst.append(base + r.dst * v.stride_bytes)
                    continue
                for i in range(r.length):
                    pieces.append((k, (r.src + i) * v.stride_bytes, v.block_bytes))
                    dst.append(base + (r.dst + i) * v.stride_bytes)
        rows = np.array(pieces, dtype=np.int64).reshape(-1, 3)
        return rows, np.array(dst, dtype=np.uint64), [v.t for vs in self.views for v in vs]

    def nbytes(self, runs: Sequence[Run]) -> int:
        return sum(r.length * sum(v.block_bytes for v in self.views[r.group]) for r in runs)
