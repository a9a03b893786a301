"""The torch thread count an engine process picks when `--threads` is not given."""

from __future__ import annotations

import logging

import pytest
import torch

from hybrid_pd.engine import threads
from hybrid_pd.engine.threads import choose_threads, set_torch_threads


@pytest.mark.parametrize(
    ("workers", "cpus", "want"),
    [(1, 1, 1), (1, 2, 2), (2, 2, 1), (3, 2, 1), (2, 16, 8), (3, 16, 5), (4, 4, 1)],
)
def test_cpus_divided_among_workers_at_least_one(workers, cpus, want):
    n, why = choose_threads(workers, cpus=cpus)
    assert n == want
    assert str(cpus) in why


def test_the_reason_names_the_sharing():
    assert choose_threads(2, cpus=2) == (1, "2 CPUs shared by 2 workers")
    assert choose_threads(1, cpus=1) == (1, "1 CPU, one engine process")


def test_zero_workers_is_an_error():
    with pytest.raises(ValueError, match="at least 1"):
        choose_threads(0, cpus=4)


def test_default_is_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5}, raising=False)
    assert choose_threads(2) == (2, "4 CPUs shared by 2 workers")


def test_set_logs_the_choice_and_the_override(monkeypatch, caplog):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="hybrid_pd.engine.threads"):
            assert set_torch_threads(None, 2) == 2
            assert torch.get_num_threads() == 2
            assert set_torch_threads(1, 2) == 1
            assert torch.get_num_threads() == 1
        assert caplog.messages == [
            "torch threads: 2 (4 CPUs shared by 2 workers)",
            "torch threads: 1 (--threads)",
        ]
    finally:
        torch.set_num_threads(before)


def test_a_worker_process_logs_its_choice(tmp_path):
    from hybrid_pd.launcher.local import start_worker

    log = tmp_path / "worker.log"
    with log.open("w") as f:
        worker = start_worker(
            "prefill", "--model", "tiny", "--kv-memory", "8MiB", "--workers-on-host", "2", log=f
        )
    try:
        n, why = choose_threads(2)
        assert f"torch threads: {n} ({why})" in log.read_text()
    finally:
        worker.stop()
