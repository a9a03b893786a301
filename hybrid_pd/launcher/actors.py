"""Ray actors: thin shells over `Worker` (all logic lives in the plain class)."""

from __future__ import annotations

import logging

from hybrid_pd.workers.worker import Worker, WorkerConfig


class WorkerActor:
    """Wrapped with `ray.remote` by the launcher; one worker process per actor."""

    def __init__(self, config: WorkerConfig, threads: int | None = None) -> None:
        logging.basicConfig(level=logging.INFO)
        if threads:
            import torch

            torch.set_num_threads(threads)
        if config.host == "auto":  # serve on this node's address (multi-node clusters)
            import dataclasses

            import ray

            config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        self.worker = Worker(config)

    def address(self) -> str:
        return self.worker.address

    def health(self) -> dict:
        """The worker's stats; raises if the pool's invariants do not hold."""
        return self.worker.stats()

    def shutdown(self) -> None:
        self.worker.close()
