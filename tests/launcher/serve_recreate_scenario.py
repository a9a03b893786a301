"""Run inside a fresh network namespace (only loopback): a worker that Ray will not restart
(killed with no_restart) is re-created by the supervisor, once; the second loss, with the
re-creations spent, marks the Deployment failed. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import time


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def main() -> int:
    import httpx
    import ray

    from hybrid_pd.engine.threads import set_torch_threads
    from hybrid_pd.launcher.serve import Deployment, ServeConfig, wait_ready

    set_torch_threads(1)  # as every engine process: subnormals flushed, then 1 thread
    result: dict = {}
    failures: list[str] = []
    config = ServeConfig(port=0, kv_memory="16MiB", threads=1, max_recreates=1)
    dep = Deployment(config, on_failure=failures.append, supervise_every_s=0.5)
    try:
        wait_ready(dep.url)
        result["secret_set"] = bool(dep.config.secret)
        old, old_actor = dep.addresses["decode"][0], dep.actors["decode"][0]
        ray.kill(old_actor, no_restart=True)  # dead for good: Ray will not bring it back
        result["recreated"] = wait_for(
            lambda: (
                dep.actors["decode"][0] is not old_actor
                and dep.addresses["decode"] != [old]
                and "error" not in dep.health.get("decode-0", {"error": ""})
            ),
            60,
        )
        result["failed_after_first"] = dep.failed.is_set()
        body = {"model": "tiny", "prompt": "a short one", "max_tokens": 4, "ignore_eos": True}
        reply = httpx.post(dep.url + "/v1/completions", json=body, timeout=60)
        result["after_recreate_status"] = reply.status_code
        ray.kill(dep.actors["decode"][0], no_restart=True)  # again: no re-creation left
        result["failed"] = dep.failed.wait(30)
        result["failure"] = dep.failure
        result["callback"] = failures
    finally:
        dep.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
