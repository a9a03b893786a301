"""Run inside a fresh network namespace (only loopback), under a Python with vLLM:
`hybrid-pd serve --engine vllm` (Deployment on embedded Ray: a prefill and a decode vLLM
server running hybrid-pd's connector, each behind our Worker API, and our proxy). Prints
one JSON line: whether the proxy's answers equal one vLLM instance's (the decode server
computing alone), and the connector's counters on both servers.

`--prefill-tp N --decode-tp M --family granite` serves a tensor-parallel pair
(test_serve_tp.py); with no arguments, Gemma 3-like at TP 1, a check run by hand
(docs/vllm.md). test_multinode.py runs the same path on a Ray cluster and uses compare()."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path


def samples(metrics: str, prefix: str) -> list[float]:
    """The values of the Prometheus samples whose line starts with `prefix`."""
    return [float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(prefix)]


def compare(got: list, want: list, proxy_metrics: str) -> dict:
    """What a scenario reports: the proxy's answers against one instance's, whether the
    references differ from prompt to prompt, and the proxy's disaggregated route count."""
    return {
        "equal": got == want,
        "got": got,
        "want": want,
        "distinct": len({json.dumps(w) for w in want}) == len(want),
        "disaggregated": samples(
            proxy_metrics, 'hybrid_pd_proxy_routes_total{route="disaggregated"}'
        ),
    }


def run_isolated(tmp_path: Path, module: str, *args: str, timeout: float = 900) -> dict:
    """Run scenario `module` (`python -m`, with `args`) in a network namespace of its own
    (only loopback, brought up) under this Python; its last JSON line, parsed. Fails with
    the end of its stderr when it exits non-zero or prints none."""
    import os
    import subprocess

    cmd = [
        "unshare", "-n", "--", "sh", "-c",
        f"ip link set lo up && exec {sys.executable} -m {module} {' '.join(args)}",
    ]  # fmt: skip
    env = {**os.environ, "HYBRID_PD_CACHE": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    import httpx
    import ray

    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready
    from hybrid_pd.workers.vllm_server import parse_metrics
    from tests.vllm_connector import checkpoints

    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=("gemma3", "granite"), default="gemma3")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--lengths", default="7,90,300")
    args = parser.parse_args(argv)
    build = {"gemma3": checkpoints.gemma3, "granite": checkpoints.granite_hybrid}[args.family]
    folder = Path(tempfile.mkdtemp(prefix="hpd-vllm-serve-"))  # removed at the end
    model = build(folder / "ckpt")
    config = ServeConfig(
        engine="vllm",
        model=str(model),
        served_model_names=("m",),
        port=0,
        min_prefill_tokens=1,
        dtype="float32",
        log_level="warning",
        prefill_tensor_parallel_size=args.prefill_tp,
        decode_tensor_parallel_size=args.decode_tp,
    )
    rng = random.Random(5)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(n)] for n in lengths]
    result: dict = {}
    counters = ("hybrid_pd_kv_",)
    started = time.monotonic()
    dep = Deployment(config)
    try:
        wait_ready(dep.url, timeout=600)
        result["start_s"] = round(time.monotonic() - started, 1)
        urls = {
            role: ray.get(dep.actors[role][0].health.remote())["vllm_url"]
            for role in ("prefill", "decode")
        }
        with (
            httpx.Client(base_url=dep.url, timeout=600) as c,
            httpx.Client(base_url=urls["decode"], timeout=600) as single,
            httpx.Client(base_url=urls["prefill"], timeout=60) as prefill,
        ):
            served = single.get("/v1/models").json()["data"][0]["id"]
            body = {
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            got, want = [], []
            for p in prompts:
                r = c.post("/v1/completions", json={**body, "model": "m", "prompt": p})
                got.append(r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)
                ref = single.post("/v1/completions", json={**body, "model": served, "prompt": p})
                want.append(ref.json()["choices"][0]["token_ids"])
            result.update(compare(got, want, c.get("/metrics").text))
            decoded = parse_metrics(single.get("/metrics").text, counters)
            result["pulls"] = decoded.get("hybrid_pd_kv_pulls_total", 0.0)
            result["decode"] = decoded
            # prefill's counters come with its engine steps: give the last release a moment
            deadline = time.monotonic() + 60
            while True:
                result["prefill"] = parse_metrics(prefill.get("/metrics").text, counters)
                released = result["prefill"].get("hybrid_pd_kv_released_total", 0.0)
                if released >= len(prompts) * args.prefill_tp or time.monotonic() > deadline:
                    break
                time.sleep(1)
        result["cpus"] = {f"{r}-{i}": a["cpus"] for (r, i), a in dep._vllm_args.items()}
        result["run_s"] = round(time.monotonic() - started, 1)
    finally:
        dep.close()
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
