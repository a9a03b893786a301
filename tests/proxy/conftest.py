"""Real worker processes (role `both`, tiny model) on 127.0.0.1 and proxies in front of them."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.tiny import TINY_NAME
from hybrid_pd.launcher.local import WorkerProcess, start_worker
from hybrid_pd.proxy.config import ProxyConfig
from hybrid_pd.proxy.routing import WorkerPool
from hybrid_pd.proxy.server import ProxyHandle

KV_MEMORY = "8MiB"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybrid-pd-cache")


@pytest.fixture(scope="session")
def tiny_path(cache_dir) -> Path:
    """The built-in model, made once in a private cache the workers share."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HYBRID_PD_CACHE", str(cache_dir))
    try:
        from hybrid_pd.engine.tiny import resolve_model

        return resolve_model(TINY_NAME)
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def workers(tiny_path, cache_dir) -> list[WorkerProcess]:
    """Two worker processes of role `both`."""
    args = ["--model", str(tiny_path), "--kv-memory", KV_MEMORY, "--threads", "1"]
    env = {"HYBRID_PD_CACHE": str(cache_dir)}
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(start_worker, "both", *args, env=env, timeout=60) for _ in range(2)]
    procs = []
    errors = []
    for f in futures:
        try:
            procs.append(f.result())
        except Exception as e:
            errors.append(e)
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="session")
def reference(tiny_path) -> Engine:
    """One in-process engine on the same checkpoint: the oracle of greedy outputs."""
    model, config, tok = load_model(tiny_path)
    return Engine(model, config, EngineConfig(kv_memory_bytes=8 * 2**20), tok)


def make_proxy(tiny_path, **fields) -> ProxyHandle:
    fields.setdefault("served_model_names", ("tiny",))
    config = ProxyConfig(port=0, model_path=str(tiny_path), **fields)
    return ProxyHandle(config, WorkerPool.from_config(config)).start()


@pytest.fixture(scope="session")
def proxy(tiny_path, workers):
    """Both workers as decode workers, no prefill pool: every request runs on one worker."""
    handle = make_proxy(tiny_path, decode_addresses=tuple(w.address for w in workers))
    yield handle
    handle.stop()
    handle.pool.close()


@pytest.fixture(scope="session")
def http(proxy):
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def oai(proxy):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=proxy.base_url, api_key="x", timeout=30, max_retries=0)
    yield client
    client.close()


def free_address() -> str:
    """127.0.0.1:PORT with nothing listening (a port the OS just handed out and took back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def assert_no_leaks(workers, timeout: float = 5.0) -> None:
    """Every worker idle with all its KV blocks free (aborts are sent in the background)."""
    import time

    from hybrid_pd.proxy.worker_client import WorkerClient

    clients = [WorkerClient(w.address, timeout_s=5) for w in workers]
    deadline = time.monotonic() + timeout
    try:
        while True:
            stats = [c.stats() for c in clients]
            if all(
                s["running"] == 0
                and s["waiting"] == 0
                and s["kv_requests"] == 0
                and s["free_blocks"] == s["num_blocks"] - 1
                and s.get("leases", 0) == 0
                for s in stats
            ):
                return
            assert time.monotonic() < deadline, f"workers not idle and free: {stats}"
            time.sleep(0.05)
    finally:
        for c in clients:
            c.close()
