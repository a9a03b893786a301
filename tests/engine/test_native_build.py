"""`native_build`: the compile pool, its cache key and its failures; the kernels built ahead
by one process while another waits for them."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from hybrid_pd.engine import native_build

pytestmark = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler")

FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC")


def _sources(folder, count):
    """`count` C files, file i defining `int f<i>(int x)` = x * (i + 2)."""
    out = []
    for i in range(count):
        src = folder / f"unit{i}.c"
        src.write_text(f"int f{i}(int x) {{ return x * {i + 2}; }}\n")
        out.append(src)
    return out


def test_more_sources_than_cpus_make_one_library_keyed_by_content_not_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_PD_KERNEL_CACHE", str(tmp_path / "cache"))
    sources = _sources(tmp_path, len(os.sched_getaffinity(0)) * 2 + 1)
    path = native_build.build_library("pool", sources, FLAGS)
    lib = ctypes.CDLL(str(path))
    assert [getattr(lib, f"f{i}")(7) for i in range(len(sources))] == [
        7 * (i + 2) for i in range(len(sources))
    ]
    mtime = path.stat().st_mtime_ns
    # the slowest-first order a caller picks is not part of what was built
    assert native_build.build_library("pool", sources[::-1], FLAGS) == path
    assert path.stat().st_mtime_ns == mtime
    assert not list((tmp_path / "cache").glob(".build-*"))


def test_a_source_that_does_not_compile_fails_the_build_with_the_compilers_message(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HYBRID_PD_KERNEL_CACHE", str(tmp_path / "cache"))
    sources = _sources(tmp_path, 3)
    sources[1].write_text("int f1(int x) { return x * ; }\n")
    with pytest.raises(OSError, match=r"unit1\.c"):
        native_build.build_library("broken", sources, FLAGS)
    cache = tmp_path / "cache"
    assert not list(cache.glob("broken-*.so")) and not list(cache.glob(".build-*"))


@pytest.mark.slow
def test_kernels_built_ahead_are_the_ones_an_engine_then_loads(tmp_path):
    """A process starts the build ahead (as `serve` does) and, while it runs, an engine
    process asks for the library: the one build is logged once, by the first, and the
    second loads its result."""
    env = {**os.environ, "HYBRID_PD_KERNEL_CACHE": str(tmp_path)}
    ahead = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
        "from hybrid_pd.engine import cpu_kernels; t = cpu_kernels.build_ahead();"
        "print('started', flush=True); t.join(); print('done', flush=True)"
    )
    engine = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
        "from hybrid_pd.engine import cpu_kernels; assert cpu_kernels.library() is not None;"
        "print(cpu_kernels.status())"
    )
    first = subprocess.Popen(
        [sys.executable, "-c", ahead], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert first.stdout is not None and first.stdout.readline().strip() == "started"
    second = subprocess.run(
        [sys.executable, "-c", engine], env=env, capture_output=True, text=True, timeout=300
    )
    rest, first_log = first.communicate(timeout=300)
    assert first.returncode == 0 and rest.strip() == "done", first_log
    assert second.returncode == 0 and second.stdout.strip() == "on", second.stderr
    assert first_log.count("building the CPU kernels") == 1, first_log
    assert "building the CPU kernels" not in second.stderr, second.stderr
    assert len(list(tmp_path.glob("cpu_kernels-*.so"))) == 1
    assert not list(tmp_path.glob(".build-*"))


def test_no_build_ahead_where_the_kernels_are_off(monkeypatch, tmp_path):
    from hybrid_pd.engine import cpu_kernels

    monkeypatch.setenv("HYBRID_PD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("HYBRID_PD_CPU_KERNELS", "0")
    assert cpu_kernels.build_ahead() is None
    assert not list(tmp_path.iterdir())
