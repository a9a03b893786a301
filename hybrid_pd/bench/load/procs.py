"""The processes of `hybrid-pd bench load`: the `serve` subprocess it starts (and stops with
everything it started), finding a worker process among its descendants to kill, and the
private network namespace the whole bench runs in.

The namespace (`unshare -n`, loopback up) holds a re-executed copy of the bench
(`python -m hybrid_pd.bench.load`, options in the environment, JSON on stdout); the
service in there listens on 127.0.0.1 only, and nothing left inside outlives the run."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybrid_pd.bench.load.options import LoadOptions

#: The child inside the network namespace reads its options from this variable.
OPTS_ENV = "HYBRID_PD_BENCH_LOAD_OPTS"


# -- the process tree ----------------------------------------------------------------------
def _stat(pid: int | str) -> tuple[int, int] | None:
    """(parent pid, start time) of a process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw.rsplit(")", 1)[1].split()
    return int(rest[1]), int(rest[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(name)) is not None:
            children.setdefault(st[0], []).append(int(name))
            starts[int(name)] = st[1]
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out[child] = starts[child]
                todo.append(child)
    return out


def _listen_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` in this network namespace."""
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def pid_listening_on(candidates: list[int], port: int) -> int | None:
    """The first of `candidates` holding a socket that listens on TCP `port`."""
    wanted = {f"socket:[{i}]" for i in _listen_inodes(port)}
    for pid in candidates:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return pid
            except OSError:
                continue
    return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# -- `serve` -------------------------------------------------------------------------------
class Serve:
    """One `hybrid-pd serve` subprocess (embedded Ray) on 127.0.0.1, a free port. Stopped with
    all its descendants."""

    def __init__(
        self,
        model: str,
        threads: int,
        prefill: int,
        decode: int,
        kv_memory: str,
        log_dir: Path,
        timeout: float,
    ) -> None:
        from hybrid_pd.api.secret import SECRET_ENV

        self.secret = secrets.token_hex(16)
        self.prefill, self.decode, self.kv_memory = prefill, decode, kv_memory
        flags = {
            "--host": "127.0.0.1",
            "--port": "0",
            "--model": model,
            "--prefill": str(prefill),
            "--decode": str(decode),
            "--kv-memory": kv_memory,
            "--threads": str(threads),
        }
        cmd = [sys.executable, "-m", "hybrid_pd.launcher.cli", "serve"]
        cmd += [x for pair in flags.items() for x in pair]
        self.log_path = log_dir / f"serve-{prefill}p{decode}d-{secrets.token_hex(3)}.log"
        self._log = open(self.log_path, "w")  # closed in stop()
        # The secret travels in the environment, not on the command line (`ps` shows that).
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", SECRET_ENV: self.secret}
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.url: str | None = None
        self._family: dict[int, int] = {}
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self._ready.wait(timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError(
                f"serve did not come up within {timeout:.0f} s "
                f"(rc {self.proc.returncode}): {self.log_tail()}"
            )
        self.startup_s = round(time.monotonic() - t0, 2)
        self.remember_family()

    def _read(self) -> None:
        """Wait for the line that says where the service is; set `url` from it."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.search(r" at (http://\S+)/v1\b", line)
            if m and self.url is None:
                self.url = m[1]
                self._ready.set()
        self._ready.set()  # serve exited

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def info(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "kv_memory": self.kv_memory,
            "startup_s": self.startup_s,
        }

    def remember_family(self) -> dict[int, int]:
        """Note every descendant now: Ray's processes outlive a dead `serve` as orphans."""
        if self.proc.poll() is None:
            self._family.update(descendants(self.proc.pid))
        return self._family

    def worker_pid(self, port: int) -> int | None:
        """The worker process serving gRPC on `port`: a descendant of our `serve`."""
        family = descendants(self.proc.pid)
        actors = [p for p in family if "WorkerActor" in _cmdline(p)]
        return pid_listening_on(actors or list(family), port)

    def kill_worker(self, pid: int) -> bool:
        """SIGKILL `pid` if (and only if) it still descends from our `serve`."""
        self.remember_family()
        if pid not in descendants(self.proc.pid):
            return False
        os.kill(pid, signal.SIGKILL)
        return True

    def stop(self, timeout: float = 90.0) -> None:
        """SIGINT (serve closes its deployment), then harder; then any descendant left."""
        family = self.remember_family()
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        end = time.monotonic() + 15
        while time.monotonic() < end and any(_stat(p) for p in family):
            time.sleep(0.2)
        for pid, start in family.items():
            st = _stat(pid)
            if st is not None and st[1] == start:  # the same process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self._log.close()


# -- a private network namespace -----------------------------------------------------------
def _netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _sweep_netns(ns: str) -> int:
    """SIGKILL what is left inside our private namespace (all of it descends from our child)."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid() and _netns(name) == ns:
            try:
                os.kill(int(name), signal.SIGKILL)
                n += 1
            except OSError:
                pass
    return n


def run_in_netns(opts: LoadOptions) -> dict[str, Any]:
    """Run the bench in a child inside a new network namespace with only loopback up."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        raise ValueError(
            "bench load runs the service in a private network namespace: it needs root, "
            "unshare and ip (or pass --no-netns to use this machine's loopback)"
        )
    own = _netns("self")
    # `-m` of the package runs its __main__.py: the child's entry point.
    script = 'ip link set lo up && exec "$0" -m hybrid_pd.bench.load'
    proc = subprocess.Popen(
        ["unshare", "-n", "--", "sh", "-c", script, sys.executable],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, OPTS_ENV: json.dumps(asdict(opts))},
    )
    ns = None
    end = time.monotonic() + 10
    while ns is None and time.monotonic() < end and proc.poll() is None:
        found = _netns(proc.pid)
        ns = found if found and found != own else None
        time.sleep(0.05)
    swept = 0
    try:
        stdout, _ = proc.communicate(timeout=opts.time_limit_s + 600)
    except BaseException:  # our own limit, or Ctrl-C: the child cleans up, or is made to
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    finally:
        if ns is not None:
            swept = _sweep_netns(ns)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the bench child failed (rc {proc.returncode}); see its stderr above")
    result = json.loads(lines[-1])
    result["meta"]["netns"] = True
    result["meta"]["leftover_processes_killed"] = swept
    return result
