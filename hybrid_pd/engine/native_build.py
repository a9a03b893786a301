"""Compile C sources into a shared library once per machine, cached by what went into it.

The engine's C code (the CPU kernels; the tensor-parallel group's shared-memory counters) is
compiled at first use with the machine's `cc` (or `$CC`) into one library per set of
sources, kept in `$HYBRID_PD_KERNEL_CACHE` (default `~/.cache/hybrid-pd/kernels`) under a
name that carries a digest of the sources' text, the flags, the compiler's version and
whatever else the caller says the build depends on. Processes that start together (a
worker's ranks, a host's workers) take a file lock, so one of them compiles and the others
load its result; a library appears whole (built aside, then renamed) or not at all. The
sources compile side by side, one compiler call per file, as many at once as the process
may use CPUs, in the order the caller gives (slowest first), then one link.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

#: Seconds one compiler call may take.
COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    given = os.environ.get("HYBRID_PD_KERNEL_CACHE")
    return Path(given) if given else Path.home() / ".cache" / "hybrid-pd" / "kernels"


def compiler() -> str | None:
    """The C compiler to use: `$CC` (default `cc`), else gcc; None if there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build_library(
    name: str,
    sources: Sequence[Path],
    flags: Sequence[str],
    *,
    depends: Sequence[Path] = (),
    key_parts: Sequence[str] = (),
    link: Sequence[str] = ("-lm",),
    what: str | None = None,
) -> Path:
    """The path of the shared library `name-<digest>.so` built from `sources` with `flags`
    (which include `-shared` and `-fPIC`), built now unless cached. The digest covers the
    text of `sources` and `depends` (headers), `flags`, the compiler's version and
    `key_parts`. `what` names the library in the build's log line. Raises OSError when
    there is no compiler or it fails."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    files = sorted({*sources, *depends})
    text = "\0".join(f"{p.name}\0{p.read_text()}" for p in files)
    parts = (text, " ".join(flags), version.stdout, *key_parts)
    key = hashlib.sha256(b"\0".join(s.encode() for s in parts)).hexdigest()[:24]
    folder = cache_dir()
    target = folder / f"{name}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    lock_path = folder / f".lock-{name}-{key}"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process builds, the others wait here
        if target.exists():
            return target
        logger.info("building %s into %s (once per machine)", what or name, target)
        _compile(cc, list(sources), tuple(flags), tuple(link), folder, target)
        # the library exists: later processes never reach the lock (waiters hold it open)
        lock_path.unlink(missing_ok=True)
    return target


def _compile(
    cc: str,
    sources: list[Path],
    flags: tuple[str, ...],
    link: tuple[str, ...],
    folder: Path,
    target: Path,
) -> None:
    """Each source to an object, then one link into `target`. The objects are compiled by a
    pool of as many compiler calls at once as this process may use CPUs, in the order of
    `sources` (the callers put the slowest first): a free slot takes the next source at
    once, so the build takes about the longest file or the total over the CPUs, whichever
    is more, not the sum of each round's slowest."""
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    try:
        objects = [work / f"{src.stem}.o" for src in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1

        def one(src: Path, obj: Path) -> str | None:
            """The compiler's error output where it failed, else None."""
            done = subprocess.run(
                [cc, *compile_flags, "-c", "-o", str(obj), str(src)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                check=False,
                timeout=COMPILE_TIMEOUT_S,
            )
            return done.stderr if done.returncode != 0 else None

        with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(sources)))) as pool:
            errors = list(pool.map(one, sources, objects))
        failed = [e for e in errors if e is not None]
        if failed:
            raise OSError(f"{cc} failed: {failed[0].strip()[-2000:]}")
        tmp = work / "lib.so"
        done = subprocess.run(
            [cc, *flags, "-o", str(tmp), *map(str, objects), *link],
            capture_output=True,
            text=True,
            check=False,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
