"""`hybrid-pd bench startup`: seconds from `hybrid-pd serve`'s start to its first answer on a
fresh machine (empty kernel and model caches), and when each step of the start was logged.

Each repetition runs in a network namespace of its own (`unshare -n`, loopback up: Ray
listens on every interface, so it never runs outside one here), as a re-executed copy of
this module (`python -m hybrid_pd.bench.startup`, options in the environment, one JSON line
on stdout). In there it points `HYBRID_PD_KERNEL_CACHE` and `HYBRID_PD_CACHE` at a fresh
temporary folder, starts `serve` with its defaults (one prefill and one decode worker) on
127.0.0.1:8000, and posts a completion every `POLL_S` until one answers 200 or the deadline
passes; then it stops `serve` (SIGTERM) and deletes the folder. The parent kills whatever
is left in the namespace afterwards.

Figures per repetition: `first_answer_s`, and `phases` (seconds from the start to the first
console line of each step: Ray up, the kernels built or loaded, each worker ready, the
proxy listening), stamped as the lines arrive.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

#: The child inside the namespace reads its options (JSON) from this variable.
OPTS_ENV = "HYBRID_PD_BENCH_STARTUP_OPTS"
#: Seconds between completion attempts.
POLL_S = 0.1
PORT = 8000
#: What starts each phase's console line (its first occurrence counts).
PHASES = {
    "ray_up": "Ray: started",
    "kernels_building": "building the CPU kernels",
    "kernels_loaded": "CPU kernels: ",
    "worker_ready": ": ready at ",
    "proxy_listening": "proxy: listening",
}


def add_startup_parser(bsub: Any) -> None:
    p = bsub.add_parser("startup", help="seconds from `serve`'s start to its first answer")
    p.add_argument("--reps", type=int, default=2, help="fresh starts, one after another")
    p.add_argument("--model", default="tiny", help="checkpoint folder or `tiny` (default)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="per start, to the answer")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd)


def _cmd(args: Any) -> int:
    if args.reps < 1 or args.timeout_s <= 0:
        raise SystemExit("--reps must be >= 1 and --timeout-s > 0")
    result = bench_startup(args.reps, args.model, args.timeout_s)
    if args.json:
        print(json.dumps(result))
    else:
        for i, rep in enumerate(result["reps"]):
            print(f"start {i + 1}: first answer after {rep['first_answer_s']} s, {rep['phases']}")
    return 0 if all(r["first_answer_s"] is not None for r in result["reps"]) else 1


def bench_startup(reps: int, model: str, timeout_s: float) -> dict[str, Any]:
    """`reps` fresh starts, each in its own network namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        raise SystemExit("bench startup runs serve in a network namespace: needs root, unshare, ip")
    from hybrid_pd.bench.load.procs import _netns, _sweep_netns
    from hybrid_pd.engine.cpu_kernels import isa

    load = os.getloadavg()
    out = []
    for _ in range(reps):
        opts = {"model": model, "timeout_s": timeout_s}
        proc = subprocess.Popen(
            ["unshare", "-n", "--", "sh", "-c",
             'ip link set lo up && exec "$0" -m hybrid_pd.bench.startup', sys.executable],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, OPTS_ENV: json.dumps(opts)},
        )  # fmt: skip
        ns, own, end = None, _netns("self"), time.monotonic() + 10
        while ns is None and time.monotonic() < end and proc.poll() is None:
            found = _netns(proc.pid)
            ns = found if found and found != own else None
            time.sleep(0.02)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s + 120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if ns is not None:
                _sweep_netns(ns)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"the bench child failed (rc {proc.returncode})")
        out.append(json.loads(lines[-1]))
    firsts = [r["first_answer_s"] for r in out if r["first_answer_s"] is not None]
    return {
        "reps": out,
        "best_first_answer_s": min(firsts) if firsts else None,
        "meta": {
            "model": model,
            "isa": isa(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_average_before": [round(x, 2) for x in load],
            "caches": "empty (kernels and model) at every start",
        },
    }


def _one_start(model: str, timeout_s: float) -> dict[str, Any]:
    """Inside the namespace: one start of `serve` with empty caches, timed."""
    import httpx

    tmp = tempfile.mkdtemp(prefix="hpd-startup-")  # short: Ray's socket paths live under it
    env = {
        **os.environ,
        "HYBRID_PD_KERNEL_CACHE": os.path.join(tmp, "kernels"),
        "HYBRID_PD_CACHE": os.path.join(tmp, "models"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": tmp,  # Ray's session files (in tmp/ray) go with the rest
    }
    env.pop(OPTS_ENV, None)
    cmd = [sys.executable, "-m", "hybrid_pd.launcher.cli", "serve", "--model", model,
           "--port", str(PORT)]  # fmt: skip
    start = time.monotonic()
    serve = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    phases: dict[str, float] = {}
    tail: list[str] = []

    def read() -> None:
        assert serve.stdout is not None
        for line in serve.stdout:
            now = round(time.monotonic() - start, 2)
            for phase, text in PHASES.items():
                if text in line and phase not in phases:
                    phases[phase] = now
            tail[:] = [*tail[-40:], line.rstrip()]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first = None
    body = {"model": model, "prompt": "Hello, world", "max_tokens": 4}
    url = f"http://127.0.0.1:{PORT}/v1/completions"
    try:
        with httpx.Client(timeout=10) as client:
            while time.monotonic() - start < timeout_s and serve.poll() is None:
                try:
                    if client.post(url, json=body).status_code == 200:
                        first = round(time.monotonic() - start, 2)
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(POLL_S)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(90)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        reader.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {"first_answer_s": first, "phases": phases}
    if first is None:
        result["serve_tail"] = tail[-20:]
    return result


def _child() -> int:
    opts = json.loads(os.environ[OPTS_ENV])
    print(json.dumps(_one_start(opts["model"], float(opts["timeout_s"]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
