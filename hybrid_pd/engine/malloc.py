"""glibc malloc settings for a process that runs an engine.

A step allocates and frees tensors of megabytes (activations, attention scores, the
Mamba2 scan's chunk products). glibc serves an allocation above its mmap threshold with
a fresh mapping and returns it to the kernel when freed, so the next step's tensor of the
same size page-faults in again; freed memory at the top of the heap is trimmed back the
same way. On one core that costs 10-40% of a prefill step at batch 8-32 (Granite-4.0-H-like
62M, `bench engine`). vLLM's CPU build avoids it by preloading tcmalloc. `tune_malloc`
keeps such memory in the process instead: allocations up to 1 GiB come from the heap,
and the heap is trimmed only past 2 GiB free at its top. The price is resident memory:
freed activations stay mapped up to the step's peak, which a worker reaches on every
large step anyway.

Set `HYBRID_PD_MALLOC=default` to leave glibc's settings alone. Where another allocator
is preloaded (tcmalloc, jemalloc) or the C library is not glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

SETTINGS = {
    "mmap_threshold": (M_MMAP_THRESHOLD, 1 << 30),
    "trim_threshold": (M_TRIM_THRESHOLD, (1 << 31) - 1),
    "top_pad": (M_TOP_PAD, 64 << 20),
}

_done: dict[str, int] | None = None


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc if version() and hasattr(libc, "mallopt") else None


def tune_malloc() -> dict[str, int]:
    """Apply SETTINGS once per process; returns what was set (empty: nothing, and why is
    logged)."""
    global _done
    if _done is not None:
        return _done
    _done = {}
    if os.environ.get("HYBRID_PD_MALLOC", "") == "default":
        logger.info("malloc: glibc defaults (HYBRID_PD_MALLOC=default)")
        return _done
    preload = os.environ.get("LD_PRELOAD", "")
    if "tcmalloc" in preload or "jemalloc" in preload:
        logger.info("malloc: preloaded allocator (%s), settings left alone", preload)
        return _done
    libc = _glibc()
    if libc is None:
        return _done
    for name, (param, value) in SETTINGS.items():
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1:
            _done[name] = value
    logger.info("malloc: %s", ", ".join(f"{k}={v}" for k, v in _done.items()) or "unchanged")
    return _done
