"""Run inside a fresh network namespace (only loopback), under a Python with vLLM:
`hybrid-pd serve --engine vllm` (a prefill and a decode vLLM server on embedded Ray), then
one vLLM worker process (a rank) of the `--victim` server is SIGKILLed. vLLM stops that
server; its worker actor ends with it and is re-created whole, with a fresh server. Prints
one JSON line: every answer against one vLLM instance's (the decode server computing
alone), the servers' process groups before and after, and the proxy's route counts.
test_serve_rank_death.py runs it."""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROUTE = 'hybrid_pd_proxy_routes_total{route="disaggregated"}'


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    import os

    import httpx
    import ray

    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready
    from hybrid_pd.workers.vllm_guard import group_members
    from tests.vllm_connector import checkpoints
    from tests.vllm_connector.serve_scenario import compare, samples

    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--victim", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    model = checkpoints.granite_hybrid(Path(tempfile.mkdtemp(prefix="hpd-vllm-death-")) / "ckpt")
    config = ServeConfig(
        engine="vllm",
        model=str(model),
        served_model_names=("m",),
        port=0,
        min_prefill_tokens=1,
        dtype="float32",
        log_level="warning",
        prefill_tensor_parallel_size=args.prefill_tp,
        restore_timeout_s=240.0,
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(n)] for n in (9, 40, 70)]
    body = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    result: dict = {}
    dep = Deployment(config)
    try:
        wait_ready(dep.url, timeout=600)

        def health(role: str) -> dict:
            return ray.get(dep.actors[role][0].health.remote(), timeout=30)

        before = {role: health(role) for role in ("prefill", "decode")}
        with httpx.Client(base_url=before["decode"]["vllm_url"], timeout=600) as single:
            served = single.get("/v1/models").json()["data"][0]["id"]
            want = [
                single.post("/v1/completions", json={**body, "model": served, "prompt": p}).json()[
                    "choices"
                ][0]["token_ids"]
                for p in prompts
            ]
        with httpx.Client(base_url=dep.url, timeout=600) as c:

            def ask(p: list[int]):
                r = c.post("/v1/completions", json={**body, "model": "m", "prompt": p})
                return r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text

            first = ask(prompts[0])
            group = before[args.victim]["server_pid"]
            ranks = [
                pid
                for pid in group_members(group)  # the server this test started
                if "VLLM::Worker" in _cmdline(pid)
            ]
            result["ranks"] = len(ranks)
            old_dir = Path(before[args.victim]["server_temp_dir"])
            segments = {
                seg.name
                for store in old_dir.glob("vllm_dist_*")
                for seg in Path("/dev/shm").glob(f"{store.name}-*")
            }
            result["segments_before"] = len(segments)
            os.kill(max(ranks), signal.SIGKILL)  # the last rank: rank 1 where there are two
            killed_at = time.monotonic()
            with ThreadPoolExecutor(len(prompts)) as pool:  # while the worker is down
                during = list(pool.map(ask, prompts))
            deadline = time.monotonic() + 300
            after = None
            while time.monotonic() < deadline:
                try:
                    h = health(args.victim)
                    if h["server_pid"] != group:
                        after = h
                        break
                except Exception:  # restarting
                    pass
                time.sleep(2)
            result["recreated_s"] = round(time.monotonic() - killed_at, 1)
            result["recreated"] = after is not None
            result["old_group_left"] = group_members(group)
            # what the dead server left: its temp folder and (TP) its shared memory
            result["old_temp_dir_left"] = old_dir.exists()
            result["old_segments_left"] = [
                p.name for p in Path("/dev/shm").glob("vllm_dist_*") if p.name in segments
            ]
            new = ray.get(dep.actors[args.victim][0].address.remote(), timeout=30)
            deadline = time.monotonic() + 120  # the supervisor's next rounds tell the proxy
            while dep.addresses[args.victim] != [new] and time.monotonic() < deadline:
                time.sleep(1)
            wait_ready(dep.url, timeout=300)
            routes = samples(c.get("/metrics").text, ROUTE)
            got_after = [ask(p) for p in prompts]
            result["routes_after"] = [
                a - b for a, b in zip(samples(c.get("/metrics").text, ROUTE), routes, strict=True)
            ]
            result.update(compare([first, *during, *got_after], [want[0], *want, *want], ""))
    finally:
        dep.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
