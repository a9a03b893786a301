"""Driver side of the multi-node test (run in the head namespace): deploy on the cluster,
send concurrent requests through the proxy, check outputs and leaks. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def main() -> int:
    import openai

    from hybrid_pd.engine.engine import Engine, EngineConfig
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.sampling import SamplingParams
    from hybrid_pd.engine.tiny import resolve_model
    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready

    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--prefill-tp", type=int, default=1)
    args = ap.parse_args()
    from hybrid_pd.engine.threads import set_torch_threads

    set_torch_threads(1)  # as every engine process: subnormals flushed, then 1 thread
    dep = Deployment(
        # The simulated hosts share one kernel, so UCX would pick shared memory between
        # them, which does not work across network namespaces (real hosts never can): TCP.
        ServeConfig(
            address=args.address,
            port=0,
            kv_memory="64MiB",
            threads=1,
            min_prefill_tokens=8,
            ucx_tls="tcp,self",
            prefill_tensor_parallel_size=args.prefill_tp,
        )
    )
    result: dict = {"addresses": dep.addresses}
    try:
        wait_ready(dep.url)
        model, config, tok = load_model(resolve_model("tiny"))
        engine = Engine(model, config, EngineConfig(kv_memory_bytes=64 * 2**20), tok)
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, 256, (20 + 3 * (i % 10),), generator=g).tolist()
            for i in range(args.requests)
        ]
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        expected = [o.token_ids for o in engine.generate(prompts, params)]
        client = openai.OpenAI(base_url=dep.url + "/v1", api_key="x", timeout=300, max_retries=0)

        def one(i: int) -> list[int]:
            out = client.completions.create(
                model="tiny",
                prompt=prompts[i],
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            return list(out.choices[0].token_ids)

        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.requests) as pool:
            got = list(pool.map(one, range(args.requests), timeout=600))
        result["seconds"] = round(time.monotonic() - t0, 2)
        result["correct"] = sum(g == e for g, e in zip(got, expected, strict=True))
        time.sleep(1.0)
        stats = dep.worker_stats()
        result["nodes"] = {k: s["address"] for k, s in stats.items()}
        result["tp"] = {k: s["tensor_parallel_size"] for k, s in stats.items()}
        result["kv_bytes_moved"] = sum(
            s.get("prefill_connector", {}).get("bytes_sent", 0) for s in stats.values()
        )
        result["connectors"] = {
            k: s.get("prefill_connector") or s.get("decode_connector") for k, s in stats.items()
        }
        result["leaked"] = {
            k: s["num_blocks"] - 1 - s["free_blocks"] + s.get("leases", 0) for k, s in stats.items()
        }
    finally:
        dep.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
