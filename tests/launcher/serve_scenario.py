"""Run inside a fresh network namespace (only loopback): `hybrid-pd serve`'s Deployment on
embedded Ray, exercised through the official openai client. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import openai
    import ray

    from hybrid_pd.engine.engine import Engine, EngineConfig
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.sampling import SamplingParams
    from hybrid_pd.engine.threads import set_torch_threads
    from hybrid_pd.engine.tiny import resolve_model
    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready

    set_torch_threads(1)  # as every engine process: subnormals flushed, then 1 thread
    result: dict = {}
    dep = Deployment(ServeConfig(port=0, kv_memory="32MiB", threads=1, lease_s=5.0))
    try:
        wait_ready(dep.url)
        client = openai.OpenAI(base_url=dep.url + "/v1", api_key="x", timeout=120)
        model, config, tok = load_model(resolve_model("tiny"))
        engine = Engine(model, config, EngineConfig(kv_memory_bytes=32 * 2**20), tok)
        prompt = "A prompt long enough to take the prefill pool and then the decode pool."
        ids = tok.encode(prompt)
        ref = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        result["completion_ok"] = out.choices[0].text == ref.text
        # Closed by default: serve made a secret; a worker RPC without it is refused.
        import grpc

        from hybrid_pd.proxy.worker_client import WorkerClient

        for role in ("prefill", "decode"):
            try:
                WorkerClient(dep.addresses[role][0], timeout_s=10).health()
                result[f"{role}_open"] = True
            except grpc.RpcError as e:
                result[f"{role}_open"] = e.code() != grpc.StatusCode.UNAUTHENTICATED
            secret = dep.config.secret
            reply = WorkerClient(dep.addresses[role][0], secret=secret, timeout_s=10).health()
            result[f"{role}_role"] = reply.role
        # Ray listens on every interface: its GCS refuses a call without serve's token.
        gcs = grpc.insecure_channel(ray.get_runtime_context().gcs_address)
        probe = gcs.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo")
        try:
            probe(b"", timeout=10)
            result["ray_open"] = True
        except grpc.RpcError as e:
            result["ray_open"] = e.code() != grpc.StatusCode.UNAUTHENTICATED
        gcs.close()
        stream = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        result["stream_ok"] = "".join(c.choices[0].text for c in stream) == ref.text
        # A prefill worker dies: Ray restarts it on a new port and the proxy follows.
        victim = dep.actors["prefill"][0]
        old = dep.addresses["prefill"][0]
        ray.kill(victim, no_restart=False)
        deadline = time.monotonic() + 120
        while dep.addresses["prefill"] == [old] and time.monotonic() < deadline:
            time.sleep(0.5)
        result["restarted"] = dep.addresses["prefill"] != [old]
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        result["after_restart_ok"] = out.choices[0].text == ref.text
        time.sleep(1.0)
        stats = dep.worker_stats()
        result["leaked"] = {
            k: s["num_blocks"] - 1 - s["free_blocks"] + s.get("leases", 0) for k, s in stats.items()
        }
    finally:
        dep.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
