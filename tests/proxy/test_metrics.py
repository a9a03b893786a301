"""Per-worker series follow the pool: a worker dropped or replaced under a new address (a
restarted actor) loses its series instead of keeping its last values. No Ray, no workers:
the pool's clients never dial (gRPC channels connect lazily)."""

from __future__ import annotations

from hybrid_pd.proxy.metrics import ProxyMetrics
from hybrid_pd.proxy.routing import WorkerPool

GAUGES = (
    "worker_up",
    "worker_num_blocks",
    "worker_free_blocks",
    "worker_running",
    "worker_waiting",
    "worker_outstanding_prefill_tokens",
    "worker_outstanding_decodes",
)


def series(text: str) -> dict[str, float]:
    """`name{labels}` -> value of the per-worker samples in an exposition text (labels in
    name order, as prometheus_client writes them)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("hybrid_pd_proxy_worker_"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def with_stats(pool: WorkerPool, address: str, free: int) -> None:
    pool.workers[address].stats = {
        "num_blocks": 100,
        "free_blocks": free,
        "running": 1,
        "waiting": 0,
    }


def test_dropped_and_replaced_workers_lose_their_series():
    pool = WorkerPool(prefill=["127.0.0.1:1001"], decode=["127.0.0.1:1002"])
    metrics = ProxyMetrics()
    try:
        with_stats(pool, "127.0.0.1:1001", 40)
        with_stats(pool, "127.0.0.1:1002", 70)
        before = series(metrics.render(pool.snapshot()).decode())
        old = 'roles="prefill",worker="127.0.0.1:1001"'
        assert before[f"hybrid_pd_proxy_worker_free_blocks{{{old}}}"] == 40
        assert before[f"hybrid_pd_proxy_worker_up{{{old}}}"] == 1
        for name in GAUGES:
            assert f"hybrid_pd_proxy_{name}{{{old}}}" in before, name

        # The prefill worker restarted on a new port; the decode worker stays.
        pool.sync(["127.0.0.1:1003"], ["127.0.0.1:1002"])
        with_stats(pool, "127.0.0.1:1003", 99)
        after = series(metrics.render(pool.snapshot()).decode())
        assert not [k for k in after if "127.0.0.1:1001" in k], after
        new = 'roles="prefill",worker="127.0.0.1:1003"'
        assert after[f"hybrid_pd_proxy_worker_free_blocks{{{new}}}"] == 99
        kept = 'roles="decode",worker="127.0.0.1:1002"'
        assert after[f"hybrid_pd_proxy_worker_free_blocks{{{kept}}}"] == 70
        assert len(after) == 2 * len(GAUGES)

        # Dropped with no replacement: nothing of it is left.
        pool.sync([], ["127.0.0.1:1002"])
        last = series(metrics.render(pool.snapshot()).decode())
        assert all("127.0.0.1:1002" in k for k in last) and len(last) == len(GAUGES)
    finally:
        pool.close()


def test_a_worker_whose_roles_change_keeps_one_set_of_series():
    pool = WorkerPool(decode=["127.0.0.1:1002"])
    metrics = ProxyMetrics()
    try:
        metrics.render(pool.snapshot())
        pool.sync(["127.0.0.1:1002"], ["127.0.0.1:1002"])  # now both roles
        text = metrics.render(pool.snapshot()).decode()
        up = [k for k in series(text) if k.startswith("hybrid_pd_proxy_worker_up{")]
        assert up == ['hybrid_pd_proxy_worker_up{roles="decode,prefill",worker="127.0.0.1:1002"}']
    finally:
        pool.close()


def test_removing_a_worker_that_never_had_stats_is_harmless():
    metrics = ProxyMetrics()
    metrics.remove_worker("127.0.0.1:9", "decode")
    assert not series(metrics.render([]).decode())
