"""The C half of the shared-memory collectives (`csrc/shm_sync.c`: sequence counters with
atomic publish and wait), compiled once per machine into a small library
(`engine.native_build`) and loaded with ctypes. Linux only (the waits sleep on futexes);
anywhere it cannot be built, `library()` is None and the group keeps gloo's collectives."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import threading
from pathlib import Path

from hybrid_pd.engine.native_build import build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "shm_sync.c"
FLAGS = ("-O2", "-std=gnu11", "-shared", "-fPIC")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> Path:
    return build_library("shm_sync", [SOURCE], FLAGS, link=(), what="the TP group's counters")


class Group(ctypes.Structure):
    """`hpd_group`: what stays the same from one all-reduce of a rank's group to the next."""

    _fields_ = (
        ("posted", ctypes.c_void_p),  # rank 0's posted counter
        ("done", ctypes.c_void_p),  # rank 0's done counter
        ("stride", ctypes.c_long),  # bytes between counters
        ("size", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("slots", ctypes.c_void_p),
        ("slot_bytes", ctypes.c_long),
        ("pids", ctypes.c_void_p),
        ("spin_us", ctypes.c_double),
        ("yield_us", ctypes.c_double),
        ("check_ms", ctypes.c_int),
        ("timeout_s", ctypes.c_double),
    )


def _declare(lib: ctypes.CDLL) -> None:
    u32, vp = ctypes.c_uint32, ctypes.c_void_p
    lib.hpd_publish.argtypes = (vp, u32)
    lib.hpd_publish.restype = None
    lib.hpd_load.argtypes = (vp,)
    lib.hpd_load.restype = u32
    lib.hpd_wait.argtypes = (
        vp,  # counters
        ctypes.c_int,  # n
        ctypes.c_long,  # stride (bytes)
        u32,  # target
        vp,  # pids (int32 per counter)
        ctypes.c_double,  # spin_us
        ctypes.c_double,  # yield_us
        ctypes.c_int,  # check_ms
        ctypes.c_double,  # timeout_s
    )
    lib.hpd_wait.restype = ctypes.c_int
    lib.hpd_group_all_reduce_f32.argtypes = (
        ctypes.POINTER(Group),  # the group's constants
        ctypes.c_uint64,  # call number
        vp,  # src
        vp,  # dst
        ctypes.c_long,  # count
    )
    lib.hpd_group_all_reduce_f32.restype = ctypes.c_int
    lib.hpd_group_all_reduce_bf16.argtypes = lib.hpd_group_all_reduce_f32.argtypes
    lib.hpd_group_all_reduce_bf16.restype = ctypes.c_int


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (not Linux, or the build failed: logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                if not sys.platform.startswith("linux"):
                    raise OSError("futexes are Linux's")
                lib = ctypes.CDLL(str(_build()))
                _declare(lib)
                _lib = lib
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                logger.warning("shared-memory collectives unavailable, using gloo's: %s", e)
            _tried = True
    return _lib
