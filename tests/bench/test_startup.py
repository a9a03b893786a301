"""`bench startup`: a fresh `serve` (empty caches) in a network namespace, timed to its
first answer, its steps in the order they happen."""

from __future__ import annotations

import os
import shutil

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0,
        reason="needs root, unshare and ip for a private network namespace",
    ),
]


def test_a_fresh_serve_answers_and_its_steps_come_in_order():
    from hybrid_pd.bench.startup import bench_startup

    result = bench_startup(1, "tiny", 240.0)
    (rep,) = result["reps"]
    first, phases = rep["first_answer_s"], rep["phases"]
    assert first is not None and first > 0, rep
    assert result["best_first_answer_s"] == first
    # empty caches: the kernels were built (by serve itself, first thing), then loaded by
    # the workers, which then came up; the proxy listened before the answer
    assert set(phases) == {
        "kernels_building", "ray_up", "kernels_loaded", "worker_ready", "proxy_listening"
    }, phases  # fmt: skip
    assert phases["kernels_building"] < phases["kernels_loaded"] <= phases["worker_ready"]
    assert phases["ray_up"] <= phases["worker_ready"] <= phases["proxy_listening"] <= first
    assert result["meta"]["cpus"] >= 1 and result["meta"]["isa"]
