"""Build and load the kernels: every C source of `csrc/` compiled for the instruction set level
of the CPU that runs them (`isa`: avx512, avx2, generic, or native off x86) into one shared
library, cached by a digest of the sources, the level and its flags and the compiler, and
loaded with ctypes; and how many threads the kernels may split over (torch's OpenMP threads,
shared, or one). See the package's docstring."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import torch

from hybrid_pd.engine.cpu_kernels.signatures import declare
from hybrid_pd.engine.native_build import build_library

# the package's name, as when the package was one module
logger = logging.getLogger(__package__)

#: The C sources (`*.c`, compiled together) and their headers (`*.h`).
CSRC = Path(__file__).with_name("csrc")
#: -fno-trapping-math: without it GCC keeps the clamps of `exp_vec` (common.h) as branches and
#: vectorises no loop that takes an exp (SiLU, GELU, softmax): 8-16x slower there. Traps are
#: never enabled in the process, so it changes no result.
FLAGS = ("-O3", "-ffp-contract=fast", "-fno-trapping-math", "-std=c11", "-shared", "-fPIC")

#: The instruction set levels the kernels are built for, and the compiler flags of each: the
#: same source, its vector paths chosen by the macros the flags define (__AVX512F__,
#: __AVX2__). Explicit levels, never the build machine's `-march=native`, so that a cache
#: shared by machines of one level holds one library for all of them; `native` only where
#: no x86 level applies (other architectures), keyed by the CPU then.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    # x86-64-v4: AVX-512 F, BW, CD, DQ, VL (all the source uses), 512-bit vectors preferred
    "avx512": ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512"),
    # x86-64-v3: AVX2, FMA, BMI1/2, F16C, MOVBE
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "generic": (),
    "native": ("-march=native",),
}
#: What a CPU must report (/proc/cpuinfo flags) to run each x86 level.
_ISA_NEEDS = {
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"},
    "avx2": {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave"},
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""
#: The library runs its OpenMP splits on torch's own runtime (see `library`).
_shared_openmp = False


def enabled_by_env() -> bool:
    return os.environ.get("HYBRID_PD_CPU_KERNELS", "1").strip().lower() not in ("0", "off", "no")


def _cpu_flags() -> set[str]:
    """The feature flags the (first) CPU reports in /proc/cpuinfo; empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def supported_isas() -> list[str]:
    """The levels this CPU can run, best first (`generic` always)."""
    if not _x86():
        return ["native", "generic"]
    flags = _cpu_flags()
    return [level for level, needs in _ISA_NEEDS.items() if needs <= flags] + ["generic"]


def isa() -> str:
    """The level the kernels are built for here: `HYBRID_PD_CPU_ISA` (avx512, avx2, generic,
    native; `auto` or unset: the best this CPU runs) where this CPU runs it, else the best
    it runs (a warning names the refused one). Tests and benchmarks set it to compare the
    levels on one machine (avx2 on an AVX-512 CPU)."""
    best = supported_isas()[0]
    asked = os.environ.get("HYBRID_PD_CPU_ISA", "auto").strip().lower()
    if asked in ("", "auto"):
        return best
    if asked not in ISA_FLAGS:
        logger.warning("HYBRID_PD_CPU_ISA=%s unknown (one of %s); using %s",
                       asked, ", ".join(ISA_FLAGS), best)  # fmt: skip
        return best
    if asked not in supported_isas() and not (asked == "native"):
        logger.warning("HYBRID_PD_CPU_ISA=%s: this CPU cannot run it; using %s", asked, best)
        return best
    return asked


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for): in the cache key
    of the `native` level only."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def torch_openmp() -> bool:
    """Whether torch's intra-op threads are OpenMP's (its CPU builds for Linux): then the
    kernels are built with OpenMP and split over those threads (`kernel_threads`)."""
    if not enabled_by_env() or os.environ.get("HYBRID_PD_KERNEL_OPENMP", "1") == "0":
        return False
    return "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux")


def _flags(level: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build for `level` (default: `isa()`)."""
    level = isa() if level is None else level
    return FLAGS + ISA_FLAGS[level] + (("-fopenmp",) if torch_openmp() else ())


def _openmp_runtimes() -> set[str]:
    """The files of the OpenMP runtimes this process has loaded (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {ln.split()[-1] for ln in maps.splitlines() if any(n in ln for n in names)}


#: The C files that take the compiler longest, slowest first (seconds of one core at -O3 on
#: a 2-core AMD EPYC, avx512 / avx2 level: 5.9 / 2.2, 2.7 / 2.3, 2.5 / 1.9, 1.7 / 1.7):
#: started first, so the short ones fill the other CPUs meanwhile (`native_build._compile`).
_SLOWEST_FIRST = ("prompt_attention.c", "decode_attention.c", "linears.c", "scans.c")


def _sources() -> list[Path]:
    """The C files, compiled side by side into one library: the slowest first, then the
    rest by name (a file not in `_SLOWEST_FIRST` is built all the same)."""
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    return sorted(CSRC.glob("*.c"), key=lambda p: (rank.get(p.name, len(rank)), p.name))


def _build() -> Path:
    """The shared library for these sources, CPU and compiler, built if not cached."""
    level = isa()
    # the CPU's identity only where the flags depend on it (`native`): an explicit level's
    # library is the same on every CPU of that level
    machine = _cpu_identity() if level == "native" else ""
    return build_library(
        f"cpu_kernels-{level}",
        _sources(),
        _flags(level),
        depends=sorted(CSRC.glob("*.h")),
        key_parts=(level, machine),
        what="the CPU kernels",
    )


def build_ahead() -> threading.Thread | None:
    """Start building this machine's library in a daemon thread and return it (None where
    the kernels are off): for a process that starts engines elsewhere on this machine
    (`serve` with its embedded Ray) and would otherwise sit idle while they import and load
    their models, before the first of them reaches `library`. The build takes the same
    file lock (`native_build`): the engines wait for it and load its result, or, where
    their flags or environment differ, build their own. A failure is only logged here (at
    debug: the engines report their own)."""
    if not enabled_by_env():
        return None

    def run() -> None:
        try:
            _build()
        except (OSError, subprocess.SubprocessError) as e:
            logger.debug("building the CPU kernels ahead failed: %s", e)

    thread = threading.Thread(target=run, name="cpu-kernels-build", daemon=True)
    thread.start()
    return thread


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, or the build failed: logged once)."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if not enabled_by_env():
            _why_not = "HYBRID_PD_CPU_KERNELS=0"
        else:
            try:
                path = _build()
                before = _openmp_runtimes()
                lib = ctypes.CDLL(str(path))
                declare(lib)
                _lib = lib
                _check_openmp(before)
                logger.info("CPU kernels: %s (%s, OpenMP: %s)", path, isa(), _shared_openmp)
            # AttributeError: a library without a function this module declares (the source
            # changed under a running install)
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                _why_not = str(e)
                logger.warning("CPU kernels unavailable, using the PyTorch path: %s", e)
        _tried = True
    return _lib


def _check_openmp(before: set[str]) -> None:
    """Split over threads only where the library found torch's OpenMP runtime already
    loaded (the loader then binds the library to it): a second runtime would start a
    second set of threads competing with torch's."""
    global _shared_openmp
    after, wanted = _openmp_runtimes(), torch_openmp()
    _shared_openmp = wanted and bool(before) and after == before
    if wanted and not _shared_openmp:
        logger.warning(
            "the CPU kernels did not share torch's OpenMP runtime (%s loaded); they run "
            "on one thread",  # and with several torch threads `threads_match` is False
            sorted(after - before) or "none",
        )


def kernel_threads() -> int:
    """How many threads the kernels may split their work over: torch's intra-op count
    where they share its OpenMP threads (`library`), else 1."""
    return torch.get_num_threads() if library() is not None and _shared_openmp else 1


def threads_match() -> bool:
    """Whether a split kernel runs on as many threads as torch's operations: always with
    one torch thread or a shared runtime. Where not, `panel_linear` and `decode_attention`
    are not used (one thread beside torch's idle ones lost to oneDNN and SDPA)."""
    return kernel_threads() == torch.get_num_threads()


def status(build: bool = True) -> str:
    """`on`, or `off (why)`, for logs and stats; builds the kernels if not tried yet (with
    `build=False`: `not loaded` then)."""
    if not _tried and not build:
        return "not loaded"
    return "on" if library() is not None else f"off ({_why_not})"
