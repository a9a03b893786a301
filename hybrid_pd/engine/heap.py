"""The garbage collector in a process that runs an engine.

Python's full (generation 2) collection walks every container object the process holds,
and after importing torch and transformers and loading a model that is a great many: a
full collection took 44-62 ms here (timed with `gc.callbacks` during a `bench engine`
run), a pause inside whichever engine step allocated the object that triggered it (a
batch-1 decode step is 13 ms). `freeze_startup_heap` collects once and moves every object
alive then into the permanent generation (`gc.freeze`), as vLLM's engine does once it has
started: later collections walk only what was created since.

Call it once per process, after the model is loaded and the engine (or worker) is built:
frozen objects are never collected again, so garbage among them that a collection would
have freed stays (the model, the modules and the engine live as long as the process
anyway). Work that runs inside a process that goes on after it (`generate`, the
benchmarks, which tests also call in-process) uses `frozen_heap`, which thaws the heap
again at the end. `HYBRID_PD_GC_FREEZE=0` leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then freeze what is alive; returns how many objects were frozen (0 where
    `HYBRID_PD_GC_FREEZE=0`)."""
    if os.environ.get("HYBRID_PD_GC_FREEZE", "1").strip().lower() in ("0", "off", "no"):
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("garbage collector: %d startup objects frozen", frozen)
    return frozen


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """`freeze_startup_heap` for the work inside the block, the frozen objects handed back
    to the collector at its end (`gc.unfreeze`)."""
    frozen = freeze_startup_heap()
    try:
        yield frozen
    finally:
        if frozen:
            gc.unfreeze()
