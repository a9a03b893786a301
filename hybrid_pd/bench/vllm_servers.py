"""vLLM OpenAI servers on loopback for the vLLM P/D tests and `hybrid-pd bench vllm`: the
product's `VllmServer` process with a client side (completions, streamed and timed, metrics),
pause / resume for benchmarks that share cores, a restart, and `start_all`, which gives a
server that fails while starting one more start. Imports no vLLM."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from hybrid_pd.workers.vllm_server import VllmServer, parse_metrics


def cpu_halves() -> tuple[str, str]:
    """Two disjoint CPU lists for two servers on one machine. Each vLLM CPU server binds
    its OpenMP threads to the cores it is given; two servers spinning on the same cores
    slow each other down by orders of magnitude."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "nobind", "nobind"
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


class Server(VllmServer):
    """A `VllmServer` with the calls benchmarks and tests make to it."""

    def restart(self) -> None:
        """Stop the server and start it again with the same arguments (a new HTTP port);
        its log goes on in the same file."""
        self._kill()
        self.client.close()
        self._out.write("\n=== restarted ===\n")
        self._out.flush()
        self._log_from = self._out.tell()
        self._launch()

    def complete(self, body: dict, headers: dict | None = None) -> dict:
        r = self.client.post("/v1/completions", json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}: {r.status_code}: {r.text[:500]}")
        return r.json()

    def stream_tokens(self, body: dict) -> list[int]:
        return self.stream_timed(body)[0]

    def stream_timed(self, body: dict) -> tuple[list[int], float, float]:
        """Streamed completion: (token ids, seconds to the first token, seconds in all)."""
        ids: list[int] = []
        t0 = time.perf_counter()
        first = None
        with self.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{self.url}: {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        got = choice.get("token_ids") or []
                        if got and first is None:
                            first = time.perf_counter() - t0
                        ids += got
        total = time.perf_counter() - t0
        return ids, (first if first is not None else total), total

    def metrics(
        self, prefixes: tuple[str, ...] = ("hybrid_pd_kv_", "vllm:kv_cache_usage_perc")
    ) -> dict[str, float]:
        """Prometheus samples whose names start with `prefixes`, summed over labels."""
        return parse_metrics(self.client.get("/metrics").text, prefixes)

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its process group): it takes no CPU
        until `resume`. For benchmarks running several servers on the same cores."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)


def start_all(servers, timeout: float = 300.0) -> None:
    """Wait for every server to be ready; one that exits while starting is started once
    more (its first error is printed), a second exit raises. vLLM's engine start binds
    ports picked by probing, which a process starting beside it can take first."""
    for server in servers:
        try:
            server.wait_ready(timeout)
        except RuntimeError as e:
            print(f"{server.log.name}: restarting after a failed start: {e}", file=sys.stderr)
            server.restart()
            server.wait_ready(timeout)
