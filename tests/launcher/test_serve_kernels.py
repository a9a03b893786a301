"""Which `serve` starts the CPU kernels' build itself: only where its workers will run
them on this machine (embedded Ray, our engine, on the CPU)."""

from __future__ import annotations

import threading

import pytest

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.launcher.serve import _build_kernels_ahead
from hybrid_pd.launcher.serve_config import ServeConfig


@pytest.fixture
def started(monkeypatch):
    """The builds `build_ahead` was asked for (each answered with a finished thread)."""
    calls = []

    def record():
        calls.append(1)
        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread

    monkeypatch.setattr(cpu_kernels, "build_ahead", record)
    return calls


@pytest.mark.parametrize(
    "settings, builds",
    [
        ({}, True),
        ({"device": "cpu"}, True),
        ({"device": "cuda"}, False),
        ({"engine": "vllm", "model": "/a/checkpoint"}, False),
        ({"address": "127.0.0.1:6379", "secret": "s" * 32}, False),
    ],
)
def test_serve_builds_ahead_only_for_workers_on_this_machines_cpu(started, settings, builds):
    thread = _build_kernels_ahead(ServeConfig(**settings))
    assert (thread is not None) == builds
    assert len(started) == int(builds)
