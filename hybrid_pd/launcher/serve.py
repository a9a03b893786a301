"""`hybrid-pd serve`: prefill and decode pools as Ray actors, and the proxy in front.

ray.init (embedded local instance, or --address of a cluster)
N prefill actors (resource "prefill"), M decode actors (resource "decode")
proxy on host:port routing through their gRPC addresses
supervisor: follows actor restarts (new addresses) and reports health
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hybrid_pd.engine.engine import EngineConfig
from hybrid_pd.kvcache.planner import parse_bytes
from hybrid_pd.workers.worker import WorkerConfig

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class ServeConfig:
    model: str = "tiny"
    prefill: int = 1
    decode: int = 1
    address: str | None = None  # Ray cluster; None: embedded local Ray
    host: str = "127.0.0.1"  # proxy
    port: int = 8000
    kv_memory: str = "1GiB"
    secret: str | None = None
    device: str | None = None
    failure_policy: str = "recompute"
    min_prefill_tokens: int = 32
    lease_s: float = 30.0
    max_restarts: int = 3
    threads: int | None = None
    #: Where workers serve gRPC: "auto" = the Ray node's address (clusters), else a host.
    worker_host: str | None = None
    #: UCX transports for KV transfers (UCX_TLS syntax); None: UCX's choice.
    ucx_tls: str | None = None

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("serve needs at least one decode worker (--decode >= 1)")
        parse_bytes(self.kv_memory)  # validates
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError("failure_policy must be 'recompute' or 'fail'")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ServeConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def worker_config(self, role: str, model_path: str) -> WorkerConfig:
        host = self.worker_host or ("127.0.0.1" if self.address is None else "auto")
        return WorkerConfig(
            role=role,
            model=model_path,
            host=host,
            device=self.device,
            engine=EngineConfig(kv_memory_bytes=parse_bytes(self.kv_memory)),
            secret=self.secret,
            lease_s=self.lease_s,
            failure_policy=self.failure_policy,
            ucx_tls=self.ucx_tls,
        )


class Deployment:
    """A running service: Ray actors, the proxy, and the supervisor thread."""

    def __init__(self, config: ServeConfig) -> None:
        import ray

        from hybrid_pd.engine.tiny import TINY_NAME, resolve_model
        from hybrid_pd.launcher.actors import WorkerActor
        from hybrid_pd.proxy.config import ProxyConfig
        from hybrid_pd.proxy.routing import WorkerPool
        from hybrid_pd.proxy.server import ProxyHandle

        self.config = config
        model_path = str(resolve_model(config.model))  # builds `tiny` once, before workers
        # Each worker resolves `tiny` on its own node (built there if missing); a checkpoint
        # path must exist at the same place on every node.
        worker_model = config.model if config.model == TINY_NAME else model_path
        if config.address is None:
            ray.init(
                address="local",  # always a new instance, even if another one runs here
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                resources={"prefill": config.prefill, "decode": config.decode},
                num_cpus=max(2, config.prefill + config.decode),
                log_to_driver=False,
            )
        else:
            ray.init(address=config.address, log_to_driver=False)
        gpu = 1 if (config.device or "").startswith("cuda") else 0
        remote = ray.remote(WorkerActor)
        self.actors: dict[str, list] = {"prefill": [], "decode": []}
        for role, count in (("prefill", config.prefill), ("decode", config.decode)):
            for _ in range(count):
                actor = remote.options(
                    resources={role: 1},
                    num_cpus=0,
                    num_gpus=gpu,
                    max_restarts=config.max_restarts,
                    max_task_retries=0,
                ).remote(config.worker_config(role, worker_model), config.threads)
                self.actors[role].append(actor)
        self.addresses = self._addresses(timeout=300)
        proxy_config = ProxyConfig(
            host=config.host,
            port=config.port,
            model_name=config.model,
            model_path=model_path,
            prefill_addresses=tuple(self.addresses["prefill"]),
            decode_addresses=tuple(self.addresses["decode"]),
            secret=config.secret,
            min_prefill_tokens=config.min_prefill_tokens,
        )
        self.pool = WorkerPool.from_config(proxy_config)
        self.proxy = ProxyHandle(proxy_config, self.pool).start()
        self.health: dict[str, Any] = {}
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()

    @property
    def url(self) -> str:
        return self.proxy.url

    def _addresses(self, timeout: float) -> dict[str, list[str]]:
        import ray

        out: dict[str, list[str]] = {}
        for role, actors in self.actors.items():
            refs = [a.address.remote() for a in actors]
            out[role] = ray.get(refs, timeout=timeout) if refs else []
        return out

    def _supervise(self, every_s: float = 2.0) -> None:
        """Follow restarted actors to their new addresses; record health."""
        import ray

        while not self._stop.wait(every_s):
            try:
                fresh = self._addresses(timeout=30)
            except Exception as e:  # an actor is restarting or gone: retry next round
                logger.warning("worker addresses unavailable: %s", e)
                continue
            if fresh != self.addresses:
                logger.warning("worker set changed: %s -> %s", self.addresses, fresh)
                self.pool.sync(fresh["prefill"], fresh["decode"], secret=self.config.secret)
                self.addresses = fresh
            for role, actors in self.actors.items():
                for i, actor in enumerate(actors):
                    try:
                        self.health[f"{role}-{i}"] = ray.get(actor.health.remote(), timeout=10)
                    except Exception as e:
                        self.health[f"{role}-{i}"] = {"error": str(e)}

    def worker_stats(self) -> dict[str, dict]:
        import ray

        return {
            f"{role}-{i}": ray.get(a.health.remote(), timeout=30)
            for role, actors in self.actors.items()
            for i, a in enumerate(actors)
        }

    def close(self) -> None:
        import ray

        self._stop.set()
        self._supervisor.join(timeout=10)
        self.proxy.stop()
        for actors in self.actors.values():
            for a in actors:
                try:
                    ray.get(a.shutdown.remote(), timeout=30)
                except Exception:  # already dead
                    pass
        ray.shutdown()  # stops the embedded instance; only disconnects from a cluster


def wait_ready(url: str, timeout: float = 120.0) -> None:
    """Block until the proxy's /health answers 200."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout:.0f} s")
