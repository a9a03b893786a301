"""`bench engine --peer vllm` without vLLM: the shared timing, and that the child process is
always stopped (a child that cannot load, one that hangs). The run against real vLLM is
tests/vllm_connector/test_bench_engine.py."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybrid_pd.bench import peer as bench_peer
from hybrid_pd.bench.peer import VllmPeer, parse_env, peer_python
from hybrid_pd.bench.peer_vllm import Timing, rates, timed_steps


def test_prefill_ends_when_every_request_has_its_first_token():
    # request "1" gets its first token one step after "0": prefill spans both steps
    script = [
        [("0", [5], False)],
        [("1", [7], False), ("0", [5, 6], False)],
        [("0", [5, 6, 1], True), ("1", [7, 8], False)],
        [("1", [7, 8, 9], True)],
    ]
    stamps: list[float] = []

    def step():
        time.sleep(0.01)
        stamps.append(time.perf_counter())
        return script[len(stamps) - 1]

    t = timed_steps(lambda: None, step, 2)
    assert t.token_ids == [[5, 6, 1], [7, 8, 9]]
    assert t.prefill_s >= 0.02 and t.decode_s >= 0.02
    prefill, decode = rates(2, 10, 3, Timing(0.5, 2.0, t.token_ids))
    assert (prefill, decode) == (40.0, 2.0)


def _peer(python: str, tmp_path: Path) -> VllmPeer:
    return VllmPeer(
        python,
        tmp_path,
        "float32",
        max_model_len=64,
        max_batch=1,
        max_batched_tokens=64,
        cpus=[0],
        env={},
    )


def _record_children(monkeypatch, tmp_path: Path) -> list:
    """The children VllmPeer starts; their logs (kept when they fail) go to tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    procs = []
    real_popen = bench_peer.subprocess.Popen

    def popen(*args, **kwargs):
        procs.append(real_popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(bench_peer.subprocess, "Popen", popen)
    return procs


def test_a_child_that_cannot_load_is_reported_and_gone(tmp_path, monkeypatch):
    # this Python has no vLLM (or, under vLLM's, no checkpoint): the child says why and exits
    procs = _record_children(monkeypatch, tmp_path)
    with pytest.raises(RuntimeError, match="vLLM peer"):
        _peer(sys.executable, tmp_path)
    assert procs and procs[0].poll() is not None


def test_a_hanging_child_times_out_and_is_killed(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    # what a vLLM child leaves in its socket folder, and where that folder was
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$VLLM_RPC_BASE_PATH" > {tmp_path}/rpc_dir\n'
        'touch "$VLLM_RPC_BASE_PATH/engine-core-ipc"\n'
        "exec sleep 600\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(bench_peer, "LOAD_TIMEOUT_S", 1.0)
    procs = _record_children(monkeypatch, tmp_path)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer"):
        _peer(str(fake), tmp_path)
    assert procs[0].poll() is not None
    assert time.monotonic() - t0 < 60
    rpc_dir = Path((tmp_path / "rpc_dir").read_text().strip())
    assert rpc_dir.parent == tmp_path and not rpc_dir.exists()  # its sockets went with it


def test_flags_say_what_is_wrong(monkeypatch):
    monkeypatch.delenv("HYBRID_PD_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit, match="--peer-python"):
        peer_python(None)
    with pytest.raises(SystemExit, match="no such file"):
        peer_python("/nonexistent/python")
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_env(["nope"])


@pytest.mark.parametrize("isa", [None, "avx2"])
def test_the_child_shares_our_session_in_a_group_of_its_own(tmp_path, monkeypatch, isa):
    # Linux's autogroup scheduler shares the CPU between sessions: a peer in a session of its
    # own would get a share of its own on a loaded machine while ours shares this one's
    import os

    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f"ps -o sid=,pgid= -p $$ > {tmp_path}/ids\n"
        f'echo "$PYTHONPATH" > {tmp_path}/pythonpath\n'
        "exec sleep 600\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(bench_peer, "LOAD_TIMEOUT_S", 2.0)
    procs = _record_children(monkeypatch, tmp_path)
    env = {"HYBRID_PD_PEER_CPU_ISA": isa} if isa else {}
    with pytest.raises(TimeoutError):
        VllmPeer(
            str(fake), tmp_path, "float32", max_model_len=64, max_batch=1,
            max_batched_tokens=64, cpus=[0], env=env,
        )  # fmt: skip
    assert procs[0].poll() is not None
    sid, pgid = map(int, (tmp_path / "ids").read_text().split())
    assert sid == os.getsid(0) and pgid == procs[0].pid
    first = (tmp_path / "pythonpath").read_text().strip().split(os.pathsep)[0]
    site = Path(bench_peer.__file__).with_name("peer_site")
    assert (Path(first) == site) == (isa is not None)


def test_peer_site_reports_no_avx512_to_vllm_only_when_asked(tmp_path):
    # what vLLM reads to pick its kernel build, in a Python started as the peer's are
    import os
    import subprocess

    site = Path(bench_peer.__file__).with_name("peer_site")
    probe = (
        "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported())"
    )
    for isa, want in (("avx2", "False False"), ("", None)):
        env = dict(os.environ, PYTHONPATH=str(site), HYBRID_PD_PEER_CPU_ISA=isa)
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        if want is not None:
            assert out.stdout.strip() == want
        else:  # left alone: the processor's own answer
            import torch

            real = f"{torch.cpu._is_avx512_supported()} {torch.cpu._is_amx_tile_supported()}"
            assert out.stdout.strip() == real
