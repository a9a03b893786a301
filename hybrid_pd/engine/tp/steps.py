"""What rank 0 tells the other ranks of its group: the pool it planned, and each step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolShape:
    """A rank's pool geometry. Every rank plans its pool from its own rank config; the
    plans must agree block for block, since one set of block tables serves them all."""

    num_blocks: int
    page_size_bytes: int
    block_size: int
    groups: int

    @classmethod
    def of(cls, pool) -> PoolShape:
        config = pool.config
        return cls(pool.num_blocks, config.page_size_bytes, config.block_size, len(config.groups))


@dataclass(frozen=True)
class StepPlan:
    """One step's work, as rank 0 scheduled it: block copies to make first (state
    snapshots), then the batch, as `engine.batch.make_batch` takes it."""

    copies: list[tuple[int, int]]
    seqs: list[tuple]
