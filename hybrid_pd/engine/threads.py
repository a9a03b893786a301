"""How many intra-op threads torch uses in a process that runs an engine, and how they treat
subnormal floats.

torch's default is every core of the machine, for every process. Worker processes that
share a host then run more compute threads than there are cores, and OpenMP threads that
wait for a descheduled peer make steps erratic. Each engine process gets its share of the
CPUs it may run on instead; `--threads` overrides.

Subnormal floats (magnitude below 1.2e-38 in float32 and bfloat16) are what decaying state
produces: the delta rule's exp(cumulative decay) in a chunk, products of small keys and
states. x86 CPUs compute with them through a slow microcode path, about 100 times slower
per operation, so a Qwen3.5 prefill spent a quarter of its time there. Every engine process
flushes them to zero instead (`flush_denormals`), before its first parallel operation: the
CPU's flush mode is per thread, and torch's OpenMP threads copy the creating thread's mode
only when the pool starts. Every engine process flushing is what keeps P/D equal to a
single engine; only values below 1.2e-38 change. The mode governs Python's floats on the
flushing thread too (a subnormal compares equal to 0), so what clients send is normalised
before it reaches a worker (`hybrid_pd/api/sampling.py`).
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


def flush_denormals() -> bool:
    """Flush subnormal floats to zero in this thread and in every compute thread torch starts
    later (see the module docstring). False where the CPU cannot (then nothing changes)."""
    return torch.set_flush_denormal(True)


def set_torch_threads(explicit: int | None, workers_on_this_host: int = 1) -> int:
    """Flush subnormals (`flush_denormals`, before any thread starts), then set torch's
    intra-op threads: `explicit` (from --threads) when given, else `choose_threads`. Logs
    what was chosen and why; returns the count."""
    flush_denormals()
    if explicit:
        n, why = explicit, "--threads"
    else:
        n, why = choose_threads(workers_on_this_host)
    torch.set_num_threads(n)
    logger.info("torch threads: %d (%s)", n, why)
    return n
