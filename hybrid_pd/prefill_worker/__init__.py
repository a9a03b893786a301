"""The prefill role: the Prefill RPC, the prefill half of the connector, KVControl and
lease expiry, built on the shared worker (`workers/`)."""

from __future__ import annotations

from hybrid_pd.prefill_worker.role import PrefillRole
from hybrid_pd.workers.config import WorkerConfig
from hybrid_pd.workers.worker import Worker

__all__ = ["PrefillRole", "build_worker"]


def build_worker(config: WorkerConfig) -> Worker:
    """A prefill worker (`config.role` "prefill") serving on its address."""
    return Worker(config, [PrefillRole])
