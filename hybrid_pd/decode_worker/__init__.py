"""The decode role: Generate, the decode half of the connector (the load path), the failure
policy and what migration needs, built on the shared worker (`workers/`)."""

from __future__ import annotations

from hybrid_pd.decode_worker.role import DecodeRole
from hybrid_pd.workers.config import WorkerConfig
from hybrid_pd.workers.worker import Worker

__all__ = ["DecodeRole", "build_worker"]


def build_worker(config: WorkerConfig) -> Worker:
    """A decode worker (`config.role` "decode") serving on its address."""
    return Worker(config, [DecodeRole])
