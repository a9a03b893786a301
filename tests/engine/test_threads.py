"""The torch thread count an engine process picks when `--threads` is not given."""

from __future__ import annotations

import logging
import subprocess
import sys

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


# A fresh process with two torch threads: products of 1e-20 and 1e-20 (1e-40) are subnormal,
# so every element of each result is 0 when every thread that computed it flushes them, and
# about 1e-38 (a 256-term sum of them) otherwise. A batched matmul (MKL) and a linear (oneDNN)
# each split their work over both threads.
_SUBNORMALS = """
import sys, torch
from hybrid_pd.engine.threads import flush_denormals, set_torch_threads
if sys.argv[1] == "engine":
    set_torch_threads(2)
else:  # a parallel operation first starts the threads, which then never flush
    torch.set_num_threads(2)
    torch.ones(1 << 22).mul_(2)
    flush_denormals()
a = torch.full((16, 256, 256), 1e-20)
print(
    int(torch.count_nonzero(torch.bmm(a, a))),
    int(torch.count_nonzero(torch.nn.functional.linear(a[0], a[1]))),
)
"""


def _nonzero_results(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", _SUBNORMALS, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [int(n) for n in out.stdout.split()]


def test_every_engine_thread_flushes_subnormals():
    if not torch.set_flush_denormal(True):  # this process already flushes (conftest)
        pytest.skip("this CPU cannot flush subnormals")
    assert _nonzero_results("engine") == [0, 0]
    # the check can fail: threads started before the flush keep their subnormals
    late = _nonzero_results("late")
    assert late[0] > 0 and late[1] > 0, late
