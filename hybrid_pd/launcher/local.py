"""Start workers as local processes (for `generate --disaggregated`, tests, benches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from hybrid_pd.api.secret import SECRET_ENV  # the worker reads its secret from it, not argv


@dataclass
class WorkerProcess:
    role: str
    address: str
    engine_id: str
    proc: subprocess.Popen
    #: The control-plane secret its RPCs need (None: an open worker, or one given a
    #: --secret-file by the caller).
    secret: str | None = None

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


def _secret_out_of_argv(args: tuple[str, ...]) -> tuple[list[str], str | None]:
    """`args` without `--secret VALUE` / `--secret=VALUE`, and that value (the last one)."""
    kept: list[str] = []
    secret = None
    it = iter(args)
    for arg in it:
        if arg == "--secret":
            secret = next(it, None)
            if secret is None:
                raise ValueError("--secret needs a value")
        elif arg.startswith("--secret="):
            secret = arg.split("=", 1)[1]
        else:
            kept.append(arg)
    return kept, secret


def start_worker(
    role: str,
    *args: str,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    log=None,
    secret: str | None = None,
) -> WorkerProcess:
    """Spawn `python -m hybrid_pd.workers.main --role ROLE ARGS` and wait until it serves.
    The worker exits when this process dies (it watches its stdin).

    The control-plane secret (`secret`, or a `--secret VALUE` among `args`) reaches the
    worker through its environment, never its command line, which every local user can read.
    This process's own HYBRID_PD_SECRET is not inherited: a worker is closed only when asked
    (`secret`, `--secret`, `--secret-file`, or HYBRID_PD_SECRET in `env`)."""
    argv, argv_secret = _secret_out_of_argv(args)
    secret = secret if secret is not None else argv_secret
    child_env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    child_env.update(env or {})
    if secret is not None:
        if not secret.strip():
            raise ValueError("the worker secret is empty")
        child_env[SECRET_ENV] = secret
    else:
        secret = child_env.get(SECRET_ENV) or None
    cmd = [sys.executable, "-m", "hybrid_pd.workers.main", "--role", role, "--watch-stdin", *argv]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log or subprocess.DEVNULL,
        env=child_env,
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
    return WorkerProcess(role, info["address"], info["engine_id"], proc, secret)
