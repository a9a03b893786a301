"""Start workers as local processes (for `generate --disaggregated`, tests, benches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass


@dataclass
class WorkerProcess:
    role: str
    address: str
    engine_id: str
    proc: subprocess.Popen

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def start_worker(
    role: str, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None, log=None
) -> WorkerProcess:
    """Spawn `python -m hybrid_pd.workers.main --role ROLE ARGS` and wait until it serves.
    The worker exits when this process dies (it watches its stdin)."""
    cmd = [sys.executable, "-m", "hybrid_pd.workers.main", "--role", role, "--watch-stdin", *args]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log or subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        text=True,
    )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line or not line[0].strip():
        proc.kill()
        proc.wait(10)
        raise RuntimeError(
            f"{role} worker did not start within {timeout:.0f} s (exit code {proc.poll()})"
        )
    info = json.loads(line[0])
    return WorkerProcess(role, info["address"], info["engine_id"], proc)
