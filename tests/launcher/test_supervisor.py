"""`serve` never sits in an endless 503: when the supervisor gives a pool up, the CLI exits
with status 3 and one line naming the pool (a stand-in Deployment here; the real supervisor
runs in test_serve.py)."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest

from hybrid_pd.launcher import cli


class LostPool:
    """Ready at once; reports a lost decode pool shortly after start."""

    instances: ClassVar[list[LostPool]] = []

    def __init__(self, config, *, on_failure=None, **_):
        self.config = config
        self.url = "http://127.0.0.1:9"
        self.failure = None
        self.closed = False
        self.instances.append(self)

        def fail():
            self.failure = "the decode pool cannot be restored: decode-0 is dead for good"
            on_failure(self.failure)

        threading.Timer(0.2, fail).start()

    def close(self):
        self.closed = True


@pytest.fixture
def stand_in(monkeypatch):
    import hybrid_pd.launcher.serve as serve

    monkeypatch.setattr(serve, "Deployment", LostPool)
    monkeypatch.setattr(serve, "wait_ready", lambda url, abort=None, **_: None)
    monkeypatch.setattr("signal.signal", lambda *_: None)
    LostPool.instances.clear()


def test_serve_exits_3_when_a_pool_is_lost(stand_in, capsys):
    assert cli.main(["serve", "--port", "0"]) == cli.EXIT_POOL_LOST == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "hybrid-pd serve: error: the decode pool cannot be restored: decode-0 is dead for good"
    )
    (dep,) = LostPool.instances
    assert dep.closed and dep.config.secret  # embedded: a generated secret reached it


def test_supervisor_settings_validated():
    from hybrid_pd.launcher.serve import ServeConfig

    assert ServeConfig().max_recreates == 2
    with pytest.raises(ValueError, match="max_recreates"):
        ServeConfig(max_recreates=-1)
    with pytest.raises(ValueError, match="restore_timeout_s"):
        ServeConfig(restore_timeout_s=0)


def test_supervisor_recreates_a_stuck_worker_then_gives_up(monkeypatch):
    """An actor that never comes back (its node is gone, say: Ray keeps it RESTARTING) is
    replaced after restore_timeout_s, and the deployment fails once re-creations are spent.
    The supervisor's state machine alone: Ray's answers are stood in for."""
    import hybrid_pd.launcher.serve as serve
    from hybrid_pd.launcher.serve import Deployment, ServeConfig

    monkeypatch.setattr(serve, "_actor_state", lambda actor: ("RESTARTING", {}))
    reasons = []
    dep = Deployment.__new__(Deployment)  # no Ray: only the supervisor's bookkeeping
    dep.config = ServeConfig(max_recreates=1, restore_timeout_s=0.05)
    dep.actors = {"prefill": [], "decode": [object()]}
    dep.addresses = {"prefill": [], "decode": ["127.0.0.1:1"]}
    dep.failed, dep.failure, dep._on_failure = threading.Event(), None, reasons.append
    dep._stop, dep.health = threading.Event(), {}
    dep._down_since, dep._down_reason, dep._recreates = {}, {}, {}
    spawned = []
    dep._spawn = lambda role, index: spawned.append(role) or object()
    first = dep.actors["decode"][0]

    dep._supervise_once()  # down, within the timeout
    assert not spawned and "restarting" in dep.health["decode-0"]["error"]
    time.sleep(0.1)
    dep._supervise_once()  # down too long: a fresh actor
    assert spawned == ["decode"] and dep.actors["decode"][0] is not first
    assert not dep.failed.is_set()
    time.sleep(0.1)
    dep._supervise_once()  # the fresh one never came either: give up
    assert dep.failed.is_set() and spawned == ["decode"]
    assert dep.failure.startswith("the decode pool cannot be restored: decode-0 is not back")
    assert dep.failure.endswith("all 1 re-creations spent") and reasons == [dep.failure]
