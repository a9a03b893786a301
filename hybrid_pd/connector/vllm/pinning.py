"""Keep the connector's I/O threads off the cores vLLM's CPU worker computes on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def io_cpus() -> set[int] | None:
    """CPUs for the connector's I/O threads: those the process was started with.

    vLLM's CPU worker pins its main thread to the compute cores it binds OpenMP to, and
    threads inherit the mask of the thread that creates them. Left there, our gRPC, UCX
    and pull threads queue behind spinning compute threads; with two servers on one
    machine that starved the KV control plane for tens of seconds. The parent process
    (engine core or API server) still has the operator's mask (taskset, cgroup)."""
    try:
        return os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # no affinity API, or the parent is gone
        return None


@contextmanager
def unpinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the block, and start the threads it starts, with the calling thread on
    `cpus`; the caller's own mask comes back afterwards."""
    own = None
    if cpus:
        try:
            own = os.sched_getaffinity(0)
            if own == cpus:
                own = None
            else:
                os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError):  # no affinity API, or a mask it may not take
            own = None
    try:
        yield
    finally:
        if own is not None:
            os.sched_setaffinity(0, own)
