"""`hybrid-pd bench proxy`: the front door on its own, as an operator sees it.

One worker process (the built-in model) and the proxy as a process of its own
(`python -m hybrid_pd.proxy`). Reports the proxy's resident memory and whether torch is
mapped into it, then sends prompts of `--prompt-mb` MB (far past max_model_len) while
timing `GET /v1/models` as fast as it answers: the front door must not stall for everyone
while one huge request is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any


def add_proxy_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "proxy", help="the proxy alone: its memory, its latency under a huge prompt"
    )
    p.add_argument("--prompt-mb", type=float, default=10.0, help="size of the huge prompt")
    p.add_argument("--reps", type=int, default=3, help="huge prompts sent, one after another")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    if not 0 < args.prompt_mb <= 15 or not 1 <= args.reps <= 20:
        raise ValueError("--prompt-mb must be in (0, 15] and --reps in [1, 20]")
    result = bench_proxy(args.prompt_mb, args.reps)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


def bench_proxy(prompt_mb: float, reps: int) -> dict[str, Any]:
    from hybrid_pd.launcher.local import start_worker
    from hybrid_pd.workers.vllm_server import free_port

    worker = start_worker("both", "--kv-memory", "32MiB", "--threads", "1")
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "hybrid_pd.proxy", "--port", str(port), "--decode", worker.address],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        model = _wait_up(url, proxy)
        rss_mib = _status_kib(proxy.pid, "VmRSS") / 1024
        with open(f"/proc/{proxy.pid}/maps") as f:
            torch_mapped = "libtorch" in f.read()
        runs = asyncio.run(_runs(url, model, prompt_mb, reps))
    finally:
        proxy.terminate()
        try:
            proxy.wait(10)
        except subprocess.TimeoutExpired:
            proxy.kill()
            proxy.wait()
        worker.stop()
    worst = [r["models_max_ms"] for r in runs]
    return {
        "proxy_rss_mib": round(rss_mib, 1),
        "torch_mapped": torch_mapped,
        "prompt_mb": prompt_mb,
        "huge_prompt_status": sorted({r["status"] for r in runs}),
        "huge_prompt_s": [r["seconds"] for r in runs],
        "models_calls": sum(r["models_calls"] for r in runs),
        "models_median_ms": round(statistics.median(m for r in runs for m in r["models_ms"]), 1),
        "models_max_ms": max(worst),
        "models_max_ms_per_rep": worst,
    }


def _wait_up(url: str, proxy: subprocess.Popen, timeout: float = 60.0) -> str:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.poll() is not None:
            raise RuntimeError(f"the proxy exited with status {proxy.returncode}")
        try:
            data = httpx.get(url + "/v1/models", timeout=5).json()["data"]
            if data:
                return data[0]["id"]
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the proxy did not come up")


async def _runs(url: str, model: str, prompt_mb: float, reps: int) -> list[dict]:
    import httpx

    words = "ab cd "
    body = {"model": model, "prompt": words * int(prompt_mb * 2**20 / len(words)), "max_tokens": 1}
    raw = json.dumps(body).encode()  # encoded up front: the client's own work is not timed
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(reps):
            start = time.perf_counter()
            big = asyncio.create_task(client.post("/v1/completions", content=raw))
            lat = []
            while not big.done() and len(lat) < 10_000:
                t = time.perf_counter()
                await client.get("/v1/models")
                lat.append(1000 * (time.perf_counter() - t))
                await asyncio.sleep(0.005)
            reply = await big
            out.append(
                {
                    "status": reply.status_code,
                    "seconds": round(time.perf_counter() - start, 3),
                    "models_calls": len(lat),
                    "models_ms": lat,
                    "models_max_ms": round(max(lat, default=0.0), 1),
                }
            )
    return out


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")
