"""A rank other than 0: it holds its shard of the weights and of the KV pool and runs every
step rank 0 announces, taking part in that step's all-reduces. It schedules nothing and
samples nothing; it learns of requests only as rows of a step, and runs its run of the
head's vocabulary rows on the rows rank 0 names (`head.HeadRows`)."""

from __future__ import annotations

import logging

import torch

from hybrid_pd.engine.batch import make_batch
from hybrid_pd.engine.engine import EngineConfig, plan_kv_cache
from hybrid_pd.engine.tp.group import TPGroup
from hybrid_pd.engine.tp.head import HeadRows, follower_logits
from hybrid_pd.engine.tp.shared_pool import create_rank_pool
from hybrid_pd.engine.tp.steps import PoolShape, StepPlan
from hybrid_pd.kvcache.pool import KVPool, num_blocks_for_memory

logger = logging.getLogger(__name__)


class Follower:
    def __init__(
        self,
        model,
        hf_config: dict,
        config: EngineConfig,
        tp: TPGroup,
        share_tag: str | None = None,
    ) -> None:
        """`model` / `hf_config`: this rank's shard and rank config; `config`: the same
        engine config rank 0 got. `share_tag`: keep the pool in shared memory under that
        tag, for rank 0 to map (`shared_pool`; a worker that hands KV over). Waits for rank
        0's pool shape and refuses to run with another (ValueError)."""
        if tp.is_leader:
            raise ValueError("rank 0 runs the Engine, not a Follower")
        self.model = model
        self.tp = tp
        device = next(model.parameters()).device
        kv_config, _ = plan_kv_cache(model, hf_config, config)
        num_blocks = num_blocks_for_memory(kv_config, config.kv_memory_bytes)
        buffer = None
        if share_tag is not None:
            page = kv_config.page_size_bytes
            buffer = create_rank_pool(share_tag, tp.rank, num_blocks, page, device)
        self.pool = KVPool(kv_config, num_blocks, device=device, held_rows_bytes=0, buffer=buffer)
        leader = tp.broadcast()
        mine = PoolShape.of(self.pool)
        if leader != mine:
            raise ValueError(f"rank {tp.rank}'s pool {mine} differs from rank 0's {leader}")
        self.steps = 0
        self.hidden: torch.Tensor | None = None  # the last step's, for the head

    def step(self, plan: StepPlan) -> None:
        self.pool.copy_blocks(plan.copies)
        with torch.inference_mode():
            self.hidden = self.model(make_batch(self.pool, plan.seqs))
        self.steps += 1

    def head(self, rows: HeadRows) -> None:
        """This rank's share of the logits of the rows rank 0 names (the result is rank
        0's to use)."""
        if self.hidden is None:
            raise RuntimeError("rank 0 asked for logits before any step")
        with torch.inference_mode():
            follower_logits(self.model, self.hidden, rows)

    def run(self) -> int:
        """Take steps (and the head's turns) until rank 0 releases the group; returns how
        many steps ran."""
        while (msg := self.tp.broadcast()) is not None:
            if isinstance(msg, HeadRows):
                self.head(msg)
            else:
                self.step(msg)
        logger.debug("rank %d released after %d steps", self.tp.rank, self.steps)
        return self.steps
