"""A tensor-parallel vLLM CPU server leaves nothing behind, even when its owner dies
without stopping it: its ranks' communicator maps shared-memory segments named after the
server's torch.distributed file store, and vLLM removes neither when it is stopped by
signal. The guard `VllmServer` starts it under does, as `VllmServer.stop` does (both lie
where the server's own temp folder says; tests/connector/test_vllm.py checks stop() with
a stand-in server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid_pd.workers.vllm_guard import SHM_DIR, group_members
from tests.vllm_connector import checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


OWNER = """
import sys, time
from pathlib import Path
from hybrid_pd.bench.vllm_servers import Server, start_all
root = Path(sys.argv[1])
server = Server(root / "ckpt", root / "owned.log", dtype="float32", cpus="0|1",
                tensor_parallel_size=2)
start_all([server])
print(server.proc.pid, server.temp_dir, flush=True)
time.sleep(900)
"""


def test_a_tp_server_whose_owner_dies_is_stopped_and_cleaned_up(tmp_path):
    """The owner (as a Ray actor would be) is SIGKILLed without stopping its server: the
    server's whole process group ends, and its temp folder and shared memory go."""
    checkpoints.granite_hybrid(tmp_path / "ckpt")
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    pgid = None
    try:
        line = owner.stdout.readline().split()
        assert line, f"the owner did not start its server: {owner.wait(60)}"
        pgid, temp_dir = int(line[0]), Path(line[1])
        group = group_members(pgid)  # the guard leads it
        assert len(group) >= 4, f"guard, API server, engine core, 2 ranks: {group}"
        stores = [p.name for p in temp_dir.glob("vllm_dist_*")]
        assert len(stores) == 1, f"one file store in the server's temp folder: {stores}"
        segments = sorted(SHM_DIR.glob(f"{stores[0]}-*"))
        assert segments, "the TP-2 server's communicator should have segments in /dev/shm"
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 90
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_members(pgid) == [], "the server's processes outlived their owner"
        assert [p for p in segments if p.exists()] == []
        assert not temp_dir.exists()
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in group_members(pgid) if pgid is not None else []:  # a failed test's
            os.kill(pid, signal.SIGKILL)
