"""A local service for the serving benchmarks: worker processes started side by side, their
KV state checked once idle (no block held, no lease: nothing leaked), and the routes the proxy
took, read from its /metrics."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

#: The aggregated proxy never disaggregates: no prompt is this long.
NEVER = 10**9


@dataclass(frozen=True)
class BenchModel:
    """A serving benchmark's model: its checkpoint folder, the name clients ask for (`tiny`
    or the folder's name) and its vocabulary size (prompts are random ids below it)."""

    path: Path
    name: str
    vocab: int

    @classmethod
    def resolve(cls, model: str) -> BenchModel:
        """`tiny` (made if missing) or a checkpoint folder."""
        from hybrid_pd.engine.tiny import resolve_model

        path = resolve_model(model)
        cfg = json.loads((path / "config.json").read_text())
        vocab = (cfg.get("text_config") or {}).get("vocab_size") or cfg.get("vocab_size")
        return cls(path, model if model == "tiny" else Path(model).name, vocab)

    def worker_args(self, kv_memory: str, threads: int) -> list[str]:
        """The worker process's flags for this model, its KV memory and torch threads."""
        return ["--model", str(self.path), "--kv-memory", kv_memory, "--threads", str(threads)]


def _start_workers(roles: list[str], args: list[str], env: dict | None) -> list:
    from hybrid_pd.launcher.local import start_worker

    with ThreadPoolExecutor(len(roles)) as ex:
        futures = [ex.submit(start_worker, role, *args, env=env, timeout=120) for role in roles]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    for w in started if errors else ():
        w.stop()
    if errors:
        raise errors[0]
    return started


def start_proxy(
    model_name: str, path: object, prefill: list, decode: list, **settings: object
) -> object:
    """A started proxy (`ProxyHandle`, on a free port) serving `model_name` (the checkpoint at
    `path`) from the `prefill` and `decode` workers; `settings`: other `ProxyConfig` fields."""
    from hybrid_pd.proxy.config import ProxyConfig
    from hybrid_pd.proxy.server import ProxyHandle

    config = ProxyConfig(
        served_model_names=(model_name,),
        model_path=str(path),
        port=0,
        prefill_addresses=tuple(w.address for w in prefill),
        decode_addresses=tuple(w.address for w in decode),
        **settings,
    )
    return ProxyHandle(config, port=0).start()


def worker_kv_check(workers: list, timeout: float = 10.0) -> list[dict]:
    """Each worker's KV state once idle (or at `timeout`): no blocks held, no leases."""
    from hybrid_pd.proxy.worker_client import WorkerClient

    out = []
    for w in workers:
        client = WorkerClient(w.address, timeout_s=5)
        try:
            deadline = time.monotonic() + timeout
            while True:
                s = client.stats()
                clean = (
                    s["kv_requests"] == 0
                    and s.get("leases", 0) == 0
                    and s["free_blocks"] == s["num_blocks"] - 1
                    and s["running"] == 0
                    and s["waiting"] == 0
                )
                if clean or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            client.close()
        keys = ("num_blocks", "free_blocks", "kv_requests", "running", "waiting")
        out.append(
            {
                "role": w.role,
                **{k: s[k] for k in keys},
                "leases": s.get("leases", 0),
                "leaked_blocks": s["num_blocks"] - 1 - s["free_blocks"],
                "clean": clean,
            }
        )
    return out


def _routes(url: str) -> dict[str, int]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    pat = r'^hybrid_pd_proxy_routes_total\{route="(\w+)"\} ([0-9.e+]+)$'
    return {m[1]: int(float(m[2])) for m in re.finditer(pat, text, re.M) if float(m[2])}
