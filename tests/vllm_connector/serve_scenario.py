"""Run inside a fresh network namespace (only loopback), under a Python with vLLM:
`hybrid-pd serve --engine vllm` (Deployment on embedded Ray: a prefill and a decode vLLM
server running hybrid-pd's connector, each behind our Worker API, and our proxy). Prints
one JSON line: whether the proxy's answers equal one vLLM instance's. A check run by hand
(docs/vllm.md); test_multinode.py runs the same path on a Ray cluster and uses compare()."""

from __future__ import annotations

import json
import random
import sys
import tempfile
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


def main() -> int:
    import httpx

    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready
    from tests.vllm_connector import checkpoints

    model = checkpoints.gemma3(Path(tempfile.mkdtemp(prefix="hpd-vllm-serve-")) / "ckpt")
    config = ServeConfig(
        engine="vllm",
        model=str(model),
        served_model_names=("m",),
        port=0,
        min_prefill_tokens=1,
        dtype="float32",
        log_level="warning",
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(n)] for n in (7, 90, 300)]
    result: dict = {}
    dep = Deployment(config)
    try:
        wait_ready(dep.url)
        import ray

        decode_url = ray.get(dep.actors["decode"][0].health.remote())["vllm_url"]
        with (
            httpx.Client(base_url=dep.url, timeout=300) as c,
            httpx.Client(base_url=decode_url, timeout=300) as single,
        ):
            served = single.get("/v1/models").json()["data"][0]["id"]
            body = {
                "max_tokens": 10,
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
            result["pulls"] = sum(samples(single.get("/metrics").text, "hybrid_pd_kv_pulls_total"))
    finally:
        dep.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
