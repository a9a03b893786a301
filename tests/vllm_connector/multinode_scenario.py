"""Driver side of the multi-node vLLM test (run in the head namespace, under a Python with
vLLM): `hybrid-pd serve --engine vllm --address HEAD` on a cluster whose prefill and decode
nodes are other hosts. Prints one JSON line: P/D answers against the decode server alone."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path


def main() -> int:
    import grpc
    import httpx

    from hybrid_pd.api.secret import SECRET_ENV
    from hybrid_pd.connector.control import call_metadata
    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready
    from hybrid_pd.proto import worker_pb2 as pb
    from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
    from tests.vllm_connector import checkpoints
    from tests.vllm_connector.serve_scenario import compare, samples

    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--decode-netns", required=True, help="to read the decode server's metrics")
    args = ap.parse_args()

    model = checkpoints.gemma3(Path(args.root) / "ckpt")
    config = ServeConfig(
        engine="vllm",
        model=str(model),
        address=args.address,
        served_model_names=("m",),
        port=0,
        min_prefill_tokens=1,
        dtype="float32",
        vllm_python=sys.executable,
        # The simulated hosts share a kernel: UCX would pick shared memory, which does not
        # work across network namespaces (real hosts never can).
        ucx_tls="tcp,self",
        log_level="warning",
    ).resolved()
    rng = random.Random(8)
    prompts = [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(n)] for n in (9, 70, 260)]
    result: dict = {}
    dep = Deployment(config)
    try:
        wait_ready(dep.url)
        result["addresses"] = dep.addresses
        meta = call_metadata(os.environ[SECRET_ENV])
        with (
            httpx.Client(base_url=dep.url, timeout=300) as c,
            grpc.insecure_channel(dep.addresses["decode"][0]) as channel,
        ):
            decode = pb_grpc.WorkerStub(channel)
            got, want = [], []
            for p in prompts:
                body = {"model": "m", "prompt": p, "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}  # fmt: skip
                r = c.post("/v1/completions", json=body)
                got.append(r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)
                # The decode server alone (no kv_transfer_params): one vLLM instance.
                alone = decode.Generate(
                    pb.GenerateRequest(
                        prompt_ids=p,
                        sampling=pb.Sampling(max_tokens=8, top_p=1.0, ignore_eos=True),
                    ),
                    metadata=meta,
                    timeout=300,
                )
                want.append([t for chunk in alone for t in chunk.token_ids])
            result.update(compare(got, want, c.get("/metrics").text))
        # The decode server's own counters (its HTTP port is on its host's loopback).
        import ray

        url = ray.get(dep.actors["decode"][0].health.remote())["vllm_url"]
        read = "import httpx, sys; print(httpx.get(sys.argv[1] + '/metrics').text)"
        text = subprocess.run(
            ["ip", "netns", "exec", args.decode_netns, sys.executable, "-c", read, url],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        result["pulls"] = sum(samples(text, "hybrid_pd_kv_pulls_total"))
    finally:
        dep.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
