"""Tensor parallelism in the engine: a worker's ranks, their shards, their steps."""

from hybrid_pd.engine.tp.group import SINGLE, TPGroup, join_group, leave_group

__all__ = ["SINGLE", "TPGroup", "join_group", "leave_group"]
