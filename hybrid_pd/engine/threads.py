"""How many intra-op threads torch uses in a process that runs an engine.

torch's default is every core of the machine, for every process. Worker processes that
share a host then run more compute threads than there are cores, and OpenMP threads that
wait for a descheduled peer make steps erratic. Each engine process gets its share of the
CPUs it may run on instead; `--threads` overrides.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def choose_threads(workers_on_this_host: int, cpus: int | None = None) -> tuple[int, str]:
    """(threads, why): the usable CPUs divided among the engine processes sharing them,
    at least 1. `cpus`: the usable CPUs (default: `usable_cpus()`)."""
    if workers_on_this_host < 1:
        raise ValueError(f"workers on this host must be at least 1, got {workers_on_this_host}")
    cpus = usable_cpus() if cpus is None else cpus
    n = max(1, cpus // workers_on_this_host)
    cpu_word = "CPU" if cpus == 1 else "CPUs"
    if workers_on_this_host == 1:
        return n, f"{cpus} {cpu_word}, one engine process"
    return n, f"{cpus} {cpu_word} shared by {workers_on_this_host} workers"


def set_torch_threads(explicit: int | None, workers_on_this_host: int = 1) -> int:
    """Set torch's intra-op threads: `explicit` (from --threads) when given, else
    `choose_threads`. Logs what was chosen and why; returns the count."""
    if explicit:
        n, why = explicit, "--threads"
    else:
        n, why = choose_threads(workers_on_this_host)
    torch.set_num_threads(n)
    logger.info("torch threads: %d (%s)", n, why)
    return n
