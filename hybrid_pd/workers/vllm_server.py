"""A vLLM OpenAI server process (`python -m vllm.entrypoints.openai.api_server`) in its own
process group, running hybrid-pd's connector: what `serve --engine vllm` starts behind each
`VllmWorker` (launcher/actors.py), and the helpers around it (free ports for its connector's
control server, Prometheus samples of its /metrics). Imports no vLLM: the server runs under
whichever Python has it. The benchmarks' and tests' client side of such a server (completions,
pause, restart) is `hybrid_pd.bench.vllm_servers.Server`."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from hybrid_pd.workers.vllm_guard import guarded, own_temp_dir, remove_temp_dir

TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


# "RuntimeError: ...", "torch.OutOfMemoryError: ...", behind any process prefix vLLM adds.
_EXCEPTION_LINE = re.compile(r"(^|[\s)\]])([\w.]+(Error|Exception|Interrupt)): ")


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for ports it hands out to `bind(port 0)` and to outgoing
    connections (Linux's default where it cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", attempts: int = 64, span: int = 1) -> int:
    """A port free on `host` now, for a server started later with it on its command line;
    with `span` > 1 the first of `span` consecutive ports all free now (a tensor-parallel
    prefill server's connector serves rank r on port + r).

    Chosen below the kernel's ephemeral range where there is room: any port from that range
    (what binding port 0 gives) can be taken between this probe and the server's own bind
    by a process that binds port 0 or connects out, and vLLM's engine start does both while
    our connector's control server waits for its turn. A port below the range is taken
    only by a process that names it."""
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    low, _ = _ephemeral_ports()
    if low - 1024 >= 2048:
        pick = random.SystemRandom()  # not the forked `random` state processes share
        for _ in range(attempts):
            port = pick.randrange(max(1024, low - 16384), low - span + 1)
            if all(_bindable(host, port + k) for k in range(span)):
                return port
    for _ in range(attempts):  # no room below the range: the kernel's picks
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if all(_bindable(host, port + k) for k in range(1, span)):
            return port
    raise OSError(f"no {span} consecutive free ports on {host} after {attempts} tries")


def _bindable(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now."""
    if port > 65535:
        return False
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def connector_config(role: str, extra: dict) -> dict:
    """--kv-transfer-config of hybrid-pd's connector."""
    return {
        "kv_connector": "HybridPDConnector",
        "kv_connector_module_path": "hybrid_pd.connector.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def parse_metrics(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """Prometheus text: samples whose names start with `prefixes`, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            name = line.split("{")[0].split(" ")[0]
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


class VllmServer:
    """One vLLM server process: started at construction, `wait_ready` until it answers
    /health, `stop` to end it and remove what it left (log stays). `url`, `port` and an
    httpx `client` for its HTTP API are set once started."""

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        dtype: str = "float32",
        role: str | None = None,
        extra: dict | None = None,
        env: dict | None = None,
        prefix_caching: bool = False,
        cpus: str = "nobind",
        kv_transfer_config: dict | None = None,
        python: str | None = None,
        single_process: bool = False,
        max_num_seqs: int = 16,
        kv_cache_bytes: int = 64 << 20,
        max_model_len: int = 1024,
        tensor_parallel_size: int = 1,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`role` + `extra`: hybrid-pd's connector; `kv_transfer_config`: any connector.
        `cpus`: VLLM_CPU_OMP_THREADS_BIND, the CPUs this server computes on. `python`: the
        interpreter that has vLLM (default: this one). `single_process`: the model runs in
        the engine-core process (vLLM's `uni` executor, its default for one GPU) instead of
        a worker process of its own (its CPU default); one Python start fewer.
        `max_num_seqs`, `kv_cache_bytes`, `max_model_len`, `tensor_parallel_size`: vLLM's
        flags of those names (with TP on the CPU, `cpus` lists each rank's CPUs, "0|1").
        `extra_args`: more flags of vLLM's server, appended as given."""
        self.log = log
        args = [
            python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1",
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-num-seqs", str(max_num_seqs),
            "--uvicorn-log-level", "warning",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        args += list(extra_args)
        if single_process:
            args += ["--distributed-executor-backend", "uni"]
        if tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if role is not None:
            kv_transfer_config = connector_config(role, extra or {})
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        full_env = dict(os.environ)
        full_env.update(
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND=cpus,
            TOKENIZERS_PARALLELISM="false",
        )
        if single_process:  # vLLM's CPU platform turns `uni` into `mp` unless this is 0
            full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for lib in TCMALLOC:
            if Path(lib).exists():
                full_env["LD_PRELOAD"] = lib
                break
        self.temp_dir = own_temp_dir(full_env)  # removed by stop()
        full_env.update(env or {})
        self._args, self._env = args, full_env
        self._out = open(log, "w")  # closed in stop()
        self._log_from = 0  # where this start's lines begin in the log (bytes)
        self._stopping = False  # set by stop(): the process's end is no surprise
        self._launch()

    def _launch(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # under the guard, which ends the server if this process dies without stop()
        self.proc = subprocess.Popen(
            guarded([*self._args, "--port", str(self.port)], self.temp_dir),
            stdin=subprocess.PIPE,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
        )
        self.client = httpx.Client(base_url=self.url, timeout=120.0)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited ({self.proc.returncode}):\n{self.first_error()}"
                    f"\n--- last lines ---\n{self.tail()}"
                )
            try:
                if self.client.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready after {timeout} s:\n{self.tail()}")

    def first_error(self, limit: int = 40) -> str:
        """The log's first traceback, up to its exception line: the root cause, which vLLM
        prints in the engine process long before the API server's own traceback ends the
        log."""
        self._out.flush()
        lines = self.log.read_bytes()[self._log_from :].decode(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if "Traceback" in line), None)
        if start is None:
            return "(no traceback in the log)"
        end = next(
            (i for i in range(start + 1, len(lines)) if _EXCEPTION_LINE.search(lines[i])),
            len(lines) - 1,
        )
        shown = lines[start : end + 1]
        if len(shown) > limit:
            shown = [*shown[:5], "...", *shown[-(limit - 6) :]]
        return "\n".join(shown)

    def tail(self, n: int = 40) -> str:
        self._out.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def watch(self, on_exit: Callable[[int], None]) -> None:
        """Call `on_exit(returncode)` from a thread of its own when the server process ends
        by itself (a crash, a rank that died and took the server with it); not when `stop`
        ended it. Watches the process running now (a restart is not followed)."""
        proc = self.proc

        def wait() -> None:
            code = proc.wait()
            if not self._stopping:
                on_exit(code)

        threading.Thread(target=wait, name="vllm-server-watch", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        self._kill()
        self.client.close()
        self._out.close()
        remove_temp_dir(self.temp_dir)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a paused server cannot exit
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc.stdin is not None:  # the guard's pipe: its server has ended
            self.proc.stdin.close()
