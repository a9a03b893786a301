"""The worker actor's shell, outside Ray: the torch threads it picks and says it picked."""

from __future__ import annotations

import re

import torch

from hybrid_pd.engine.engine import EngineConfig
from hybrid_pd.engine.threads import choose_threads
from hybrid_pd.launcher.actors import WorkerActor
from hybrid_pd.workers.worker import WorkerConfig


def _config() -> WorkerConfig:
    return WorkerConfig(
        role="prefill",
        model="tiny",
        host="127.0.0.1",
        port=0,
        engine=EngineConfig(kv_memory_bytes=8 * 2**20),
        secret="s3cret",
    )


def test_actor_shares_the_cpus_among_the_workers_on_its_host(capfd):
    before = torch.get_num_threads()
    actor = WorkerActor(_config(), None, name="prefill-0", workers_on_host=3)
    try:
        n, why = choose_threads(3)
        assert torch.get_num_threads() == n
        assert re.search(
            rf"INFO hybrid_pd\.engine\.threads: torch threads: {n} \({why}\)$",
            capfd.readouterr().err,
            re.M,
        )
    finally:
        actor.shutdown()
        torch.set_num_threads(before)


def test_threads_given_win(capfd):
    before = torch.get_num_threads()
    actor = WorkerActor(_config(), 2, name="decode-0", workers_on_host=3)
    try:
        assert torch.get_num_threads() == 2
        assert "torch threads: 2 (--threads)" in capfd.readouterr().err
    finally:
        actor.shutdown()
        torch.set_num_threads(before)
