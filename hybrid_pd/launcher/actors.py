"""Ray actors: thin shells over `Worker` (all logic lives in the plain class)."""

from __future__ import annotations

from hybrid_pd.launcher.console import configure_logging, name_log_prefix
from hybrid_pd.workers.worker import Worker, WorkerConfig


class WorkerActor:
    """Wrapped with `ray.remote` by the launcher; one worker process per actor.

    `name` (e.g. `prefill-0`) is its `repr`, which Ray puts in front of every line the actor
    writes when it forwards them to the driver's console: `(prefill-0 pid=...) ...`; it is
    announced first thing, so that the lines of model loading carry it too."""

    def __init__(
        self,
        config: WorkerConfig,
        threads: int | None = None,
        *,
        name: str = "worker",
        log_level: str = "info",
    ) -> None:
        self.name = name
        name_log_prefix(name)
        configure_logging(log_level)  # stderr, which Ray forwards to `serve`'s console
        if threads:
            import torch

            torch.set_num_threads(threads)
        if config.host == "auto":  # serve on this node's address (multi-node clusters)
            import dataclasses

            import ray

            config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        self.worker = Worker(config)

    def __repr__(self) -> str:
        return self.name

    def address(self) -> str:
        return self.worker.address

    def health(self) -> dict:
        """The worker's stats; raises if the pool's invariants do not hold."""
        return self.worker.stats()

    def shutdown(self) -> None:
        self.worker.close()
