"""The state of a running service, as `hybrid-pd bench load` checks it: its workers (from the
proxy's /health) and each worker's KV blocks and leases (from the worker's own Stats), waited
on until the pool is idle: blocks still held then are leaks."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any


def _health(url: str) -> dict:
    import httpx

    r = httpx.get(url + "/health", timeout=10, trust_env=False)
    return r.json()


def worker_with_role(url: str, role: str) -> dict | None:
    for w in _health(url).get("workers", []):
        if role in w["roles"]:
            return w
    return None


def _worker_row(w: dict, secret: str) -> dict[str, Any]:
    """One worker as /health shows it, completed by its own Stats; `clean` when it is up and
    idle and holds no blocks and no leases."""
    from hybrid_pd.proxy.worker_client import WorkerClient

    row = {k: w.get(k) for k in ("address", "roles", "healthy", "running", "waiting")}
    row.update(num_blocks=w.get("num_blocks"), free_blocks=w.get("free_blocks"))
    client = WorkerClient(w["address"], secret=secret, timeout_s=5)
    try:
        s = client.stats()
        row.update({k: s.get(k) for k in ("num_blocks", "free_blocks", "running", "waiting")})
        row.update(
            leases=s.get("leases", 0),
            kv_requests=s.get("kv_requests"),
            cached_blocks=s.get("cached_blocks"),
        )
    except Exception as e:  # a dead or restarting worker
        row["error"] = f"Stats: {type(e).__name__}: {e}"[:200]
    finally:
        client.close()
    n, free = row["num_blocks"], row["free_blocks"]
    row["leaked_blocks"] = n - 1 - free if n is not None and free is not None else None
    row["clean"] = bool(
        row["healthy"]
        and "error" not in row
        and row["leaked_blocks"] == 0
        and not row.get("leases")
        and not row.get("kv_requests")
        and not row["running"]
        and not row["waiting"]
    )
    return row


def kv_state(url: str, secret: str, expect: dict[str, int]) -> tuple[list[dict], bool]:
    """Each worker's KV blocks and leases now; clean when every expected worker (role ->
    count) is there and every worker is clean."""
    try:
        workers = _health(url).get("workers", [])
    except Exception as e:  # the proxy itself is gone or garbled
        return [{"error": f"/health: {type(e).__name__}: {e}"}], False
    rows = [_worker_row(w, secret) for w in workers]
    roles = Counter(r for w in workers for r in w["roles"])
    complete = all(roles[r] == n for r, n in expect.items())
    return rows, complete and all(row["clean"] for row in rows)


def settle(url: str, secret: str, expect: dict[str, int], timeout: float) -> dict[str, Any]:
    """Wait (bounded) for an idle pool, then report its blocks: leaks are what is left."""
    t0 = time.monotonic()
    while True:
        rows, clean = kv_state(url, secret, expect)
        if clean or time.monotonic() - t0 >= timeout:
            break
        time.sleep(0.5)
    leaked = {
        "+".join(r.get("roles") or ["?"]) + "@" + str(r.get("address")): r.get("leaked_blocks")
        for r in rows
    }
    return {
        "workers": rows,
        "leaked_blocks": leaked,
        "clean": clean,
        "settle_s": round(time.monotonic() - t0, 2),
    }
