"""The roles' assembly: a worker of any role, "both" (aggregated) included.

The one module besides the launcher that imports both role packages. Each role package
builds its own worker from the shared plumbing (`prefill_worker.build_worker`,
`decode_worker.build_worker`); an aggregated worker is the plumbing with both roles,
composed here. `python -m hybrid_pd.workers.main` and the launcher's Ray actors come here.
"""

from __future__ import annotations

import sys

from hybrid_pd.decode_worker import DecodeRole
from hybrid_pd.prefill_worker import PrefillRole
from hybrid_pd.workers.config import WorkerConfig
from hybrid_pd.workers.worker import RoleFactory, Worker

#: The roles a worker of each `WorkerConfig.role` serves with.
ROLE_PARTS: dict[str, tuple[RoleFactory, ...]] = {
    "prefill": (PrefillRole,),
    "decode": (DecodeRole,),
    "both": (PrefillRole, DecodeRole),
}


def build_worker(config: WorkerConfig) -> Worker:
    """The worker `config.role` asks for, serving on its address."""
    return Worker(config, ROLE_PARTS[config.role])


def main(argv: list[str] | None = None) -> int:
    """The worker process (`hybrid_pd.workers.main`'s flags) with this assembly."""
    from hybrid_pd.workers.main import main as run

    return run(argv, build_worker)


if __name__ == "__main__":
    sys.exit(main())
