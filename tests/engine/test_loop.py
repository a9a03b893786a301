"""The engine loop's posted work: a post whose caller gave up (its Future cancelled before
the engine thread reached it) is skipped and the loop goes on serving; posts left when the
loop stops fail instead of leaving their callers waiting."""

from __future__ import annotations

import threading
import time

import pytest

from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.engine.tiny import TINY_NAME, resolve_model


@pytest.fixture
def loop(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_PD_CACHE", str(tmp_path))
    model, config, tok = load_model(resolve_model(TINY_NAME))
    loop = EngineLoop(Engine(model, config, EngineConfig(kv_memory_bytes=4 << 20), tok))
    yield loop
    loop.stop()


def _hold(loop: EngineLoop) -> threading.Event:
    """Keeps the engine thread busy in a posted call until the returned event is set."""
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(10)

    loop.post(hold)
    assert busy.wait(10)
    return release


def test_a_cancelled_post_is_skipped_and_the_loop_lives_on(loop):
    release = _hold(loop)
    ran = []
    skipped = loop.post(ran.append, "ran")
    assert skipped.cancel()  # the caller left before the engine thread took it
    release.set()
    # A cancelled Future cannot take a result: the engine thread must not even try
    # (that raised InvalidStateError on it and ended the loop).
    assert loop.post(lambda: 42).result(timeout=10) == 42
    assert ran == []


def test_posts_left_when_the_loop_stops_fail_instead_of_hanging(loop):
    release = _hold(loop)
    late = loop.post(lambda: 42)  # queued behind the held call
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    time.sleep(0.2)  # stop() has asked the loop to end
    release.set()
    stopper.join(15)
    with pytest.raises(RuntimeError, match="stopped"):
        late.result(timeout=5)
