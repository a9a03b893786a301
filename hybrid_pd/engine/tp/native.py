"""The C half of the shared-memory collectives (`csrc/shm_sync.c`: sequence counters with
atomic publish and wait), compiled once per machine with `cc` into a small library cached by
a digest of the source, the flags and the compiler, and loaded with ctypes. Linux only (the
waits sleep on futexes); anywhere it cannot be built, `library()` is None and the group
keeps gloo's collectives."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "shm_sync.c"
FLAGS = ("-O2", "-std=gnu11", "-shared", "-fPIC")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    given = os.environ.get("HYBRID_PD_KERNEL_CACHE")
    return Path(given) if given else Path.home() / ".cache" / "hybrid-pd" / "kernels"


def _build() -> Path:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (SOURCE.read_text(), " ".join(FLAGS), version.stdout))
    ).hexdigest()[:24]
    folder = _cache_dir()
    target = folder / f"shm_sync-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # a worker's ranks start together: one builds, the others wait for it
    with open(folder / f".lock-shm_sync-{key}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(prefix=".shm_sync-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run(
                [cc, *FLAGS, "-o", tmp, str(SOURCE)],
                capture_output=True,
                text=True,
                check=False,
                timeout=120,
            )
            if done.returncode != 0:
                raise OSError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


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
