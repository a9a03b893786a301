"""A vLLM server outlives no owner: `VllmServer` starts it under a guard that, when the
owning process dies without stopping it (a Ray actor killed or crashed), ends the server's
whole process group and removes its temp folder and the shared memory named after it.
Here a stand-in server (a shell script that leaves what a TP-2 vLLM CPU server leaves, and
has a child of its own, as vLLM's engine process is) is owned by a real Python process
that is then SIGKILLed; the subject is the guard, so nothing of vLLM is needed."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hybrid_pd.workers.vllm_guard import SHM_DIR

pytestmark = pytest.mark.timeout(120)

OWNER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from hybrid_pd.workers.vllm_server import VllmServer

    root = Path(sys.argv[1])
    server = VllmServer(root / "model", root / "server.log", python=str(root / "python"))
    print(server.temp_dir, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


def test_a_server_whose_owner_is_killed_is_stopped_and_cleaned_up(tmp_path):
    store = f"vllm_dist_{secrets.token_hex(16)}"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f'touch "$TMPDIR/{store}" "{SHM_DIR}/{store}-tp:0-[0-1]-cpushm_0"\n'
        "sleep 600 &\n"  # a child of its own, like vLLM's engine-core process
        f"echo $! > {tmp_path}/child\n"
        f"echo $$ > {tmp_path}/server\n"
        "exec sleep 600\n"
    )
    fake.chmod(0o755)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        temp_dir = Path(owner.stdout.readline().strip())
        _wait_for(lambda: (tmp_path / "server").exists(), 30, "the server started")
        _wait_for(lambda: (tmp_path / "child").stat().st_size > 0, 30, "its child started")
        pids = [int((tmp_path / n).read_text()) for n in ("server", "child")]
        assert all(_alive(p) for p in pids)
        assert (temp_dir / store).exists()
        assert (SHM_DIR / f"{store}-tp:0-[0-1]-cpushm_0").exists()
        owner.kill()  # no stop(): the server's owner just dies
        owner.wait(10)
        _wait_for(lambda: not any(_alive(p) for p in pids), 45, "the server and its child ended")
        _wait_for(lambda: not temp_dir.exists(), 10, "its temp folder was removed")
        assert list(SHM_DIR.glob(f"{store}-*")) == []
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for segment in SHM_DIR.glob(f"{store}-*"):
            segment.unlink()


def test_the_guard_ends_as_its_server_ended(tmp_path):
    """The owner sees the server's own status through the guard: its exit code, or the
    signal that ended it."""
    from hybrid_pd.workers.vllm_guard import guarded

    for script, want in (("exit 3", 3), ("kill -TERM $$", -signal.SIGTERM)):
        # as VllmServer starts it: a session of its own, the pipe held open meanwhile
        proc = subprocess.Popen(
            guarded(["sh", "-c", script], tmp_path / "t"),
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            assert proc.wait(30) == want, script
        finally:
            proc.stdin.close()


def test_a_guard_without_a_session_of_its_own_ends_only_its_command(tmp_path):
    """Started inside its starter's process group, a guard whose pipe closes stops its
    command and signals nothing else of the group (this test's own process included)."""
    from hybrid_pd.workers.vllm_guard import guarded

    got = []
    old = signal.signal(signal.SIGTERM, lambda *_: got.append("SIGTERM"))
    try:
        proc = subprocess.Popen(guarded(["sleep", "600"], tmp_path / "t"), stdin=subprocess.PIPE)
        time.sleep(0.5)
        proc.stdin.close()  # the owner "goes"
        assert proc.wait(45) == -signal.SIGTERM  # the command's end, passed on
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert got == [], "the guard signalled its starter's process group"


def test_watch_reports_a_server_that_ends_by_itself_and_not_one_that_is_stopped(tmp_path):
    """`VllmServer.watch`: what makes `serve`'s vLLM worker end (and be re-created) when its
    server dies under it, as a rank that dies takes vLLM's server down."""
    import threading

    from hybrid_pd.workers.vllm_server import VllmServer

    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nwhile [ ! -e {tmp_path}/die ]; do sleep 0.05; done\nexit 9\n")
    fake.chmod(0o755)
    for dies in (True, False):
        ended: list[int] = []
        called = threading.Event()
        server = VllmServer(tmp_path / "model", tmp_path / "server.log", python=str(fake))
        try:
            server.watch(
                lambda code, ended=ended, called=called: (ended.append(code), called.set())
            )
            if dies:
                (tmp_path / "die").touch()
                assert called.wait(30), "the watch did not report the server's end"
                assert ended == [9]
        finally:
            server.stop()
            (tmp_path / "die").unlink(missing_ok=True)
        time.sleep(0.5)  # a report from a stop would come now
        assert ended == ([9] if dies else [])
