"""hybrid-pd's connector inside real vLLM servers.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own
(docs/vllm.md; `.ci/run` builds it). This test runs that environment's pytest on
tests/vllm_connector and requires every test there to run and pass. Without the
environment it is skipped, unless HYBRID_PD_REQUIRE_VLLM=1 (as in CI)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hybrid_pd.bench.vllm_servers import Server, start_all

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("HYBRID_PD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _has_vllm() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, hybrid_pd"], capture_output=True, timeout=300
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_vllm_servers_with_hybrid_pd_connector():
    if not _has_vllm():
        if os.environ.get("HYBRID_PD_REQUIRE_VLLM") == "1":
            pytest.fail(f"HYBRID_PD_REQUIRE_VLLM=1 but {VLLM_PYTHON} cannot import vllm")
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (see docs/vllm.md)")
    out = subprocess.run(
        [str(VLLM_PYTHON), "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider",
         "tests/vllm_connector"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )  # fmt: skip
    log = out.stdout + out.stderr
    # The first failure's report (its root cause) and the summary at the end.
    starts = (log.find("= ERRORS ="), log.find("= FAILURES ="))
    first = min((i for i in starts if i >= 0), default=-1)
    tail = (log[first : first + 8000] + "\n[...]\n" if first >= 0 else "") + log[-3000:]
    assert out.returncode == 0, tail
    # pytest's last line, not what an extension prints at the interpreter's exit after it
    lines = log.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ passed", ln)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    assert counts.get("passed", 0) >= 20, tail
    assert not counts.get("skipped") and not counts.get("failed"), tail


def test_a_server_that_fails_to_start_is_started_once_more_and_its_root_cause_named(tmp_path):
    """start_all: a server exiting while it starts gets one more start; a second exit raises
    with the first traceback of that start (vLLM's engine process prints the cause long
    before the API server's own traceback ends the log). The server's socket folder goes
    with stop()."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'touch "$VLLM_RPC_BASE_PATH/engine-core-ipc"\n'  # what vLLM's ZMQ sockets leave
        'echo "(EngineCore pid=1) ERROR Traceback (most recent call last):"\n'
        'echo "(EngineCore pid=1) ERROR   File \\"core.py\\", line 1"\n'
        'echo "(EngineCore pid=1) ERROR OSError: [Errno 98] Address already in use"\n'
        'echo "Traceback (most recent call last):"\n'
        'echo "RuntimeError: Engine core initialization failed."\n'
        "exit 1\n"
    )
    fake.chmod(0o755)
    server = Server(tmp_path / "model", tmp_path / "server.log", python=str(fake))
    try:
        with pytest.raises(RuntimeError) as err:
            start_all([server], timeout=30)
        assert (server.temp_dir / "engine-core-ipc").exists()
    finally:
        server.stop()
    assert not server.temp_dir.exists()  # stop() removes what the server left there
    message = str(err.value)
    assert "vLLM server exited (1)" in message
    first = message.split("--- last lines ---")[0]
    assert "OSError: [Errno 98] Address already in use" in first
    assert "Engine core initialization failed" not in first
    assert (tmp_path / "server.log").read_text().count("=== restarted ===") == 1


def test_stop_removes_the_file_store_and_the_shared_memory_named_after_it(tmp_path):
    """A tensor-parallel vLLM CPU server stopped by signal leaves its torch.distributed file
    store in its temp folder and its communicator's segments in /dev/shm, named after the
    store. stop() removes both, whether the server is still running or already gone, and
    no segment of another server (another store's name)."""
    import secrets

    from hybrid_pd.workers.vllm_guard import SHM_DIR

    own, other = (f"vllm_dist_{secrets.token_hex(16)}" for _ in range(2))
    kept = SHM_DIR / f"{other}-tp:0-[0-1]-cpushm_0"
    kept.touch()
    fake = tmp_path / "python"
    fake.write_text(  # what vLLM's TP-2 CPU server leaves, then serves until stopped
        "#!/bin/sh\n"
        f'touch "$TMPDIR/{own}"\n'
        f'touch "{SHM_DIR}/{own}-tp:0-[0-1]-cpushm_0" "{SHM_DIR}/{own}-tp:0-[0-1]-cpushm_1"\n'
        "exec sleep 600\n"
    )
    fake.chmod(0o755)
    try:
        for exits_first in (False, True):
            server = Server(tmp_path / "model", tmp_path / "server.log", python=str(fake))
            try:
                for _ in range(200):  # until the fake has written its files (<= 20 s)
                    if len(list(SHM_DIR.glob(f"{own}-*"))) == 2:
                        break
                    time.sleep(0.1)
                assert (server.temp_dir / own).exists()
                assert len(list(SHM_DIR.glob(f"{own}-*"))) == 2
                if exits_first:  # a server that died on its own (killed, crashed)
                    os.killpg(server.proc.pid, signal.SIGKILL)
                    server.proc.wait(10)
            finally:
                server.stop()
            assert list(SHM_DIR.glob(f"{own}-*")) == []
            assert not server.temp_dir.exists()
        assert kept.exists()
    finally:
        kept.unlink(missing_ok=True)
        for segment in SHM_DIR.glob(f"{own}-*"):
            segment.unlink()


def test_free_port_is_below_the_ephemeral_range_and_free():
    """A port we name on a server's command line must not come from the range the kernel
    hands to `bind(port 0)`: vLLM's engine start binds such ports while our connector's
    control server waits for its turn, and took the control port once."""
    import socket

    from hybrid_pd.workers.vllm_server import _ephemeral_ports, free_port

    low, high = _ephemeral_ports()
    assert 1024 <= low <= high
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # picked at random, not a fixed sequence
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert low <= taken <= high  # what vLLM's probing gets, never what free_port gives
