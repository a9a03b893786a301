"""Prometheus metrics of one proxy app (its own registry), and the request-counting middleware."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WORKER_GAUGES = {
    "num_blocks": "KV blocks of the worker's pool",
    "free_blocks": "free KV blocks of the worker's pool (last Stats)",
    "running": "requests running on the worker (last Stats)",
    "waiting": "requests waiting on the worker (last Stats)",
    "outstanding_prefill_tokens": "prompt tokens of the proxy's prefills in flight there",
    "outstanding_decodes": "decode streams the proxy has open there",
}


class ProxyMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def metric(kind, name: str, doc: str, labels=(), **kwargs):
            """A `kind` series ``hybrid_pd_proxy_<name>`` in this proxy's registry."""
            return kind("hybrid_pd_proxy_" + name, doc, labels, registry=self.registry, **kwargs)

        latency = {"buckets": _LATENCY_BUCKETS}
        self.requests = metric(
            Counter, "requests", "HTTP requests by endpoint and status", ["endpoint", "status"]
        )
        self.ttft = metric(
            Histogram, "time_to_first_token_seconds", "request arrival to first token", **latency
        )
        self.itl = metric(
            Histogram,
            "inter_token_latency_seconds",
            "time between successive output tokens",
            buckets=_ITL_BUCKETS,
        )
        self.e2e = metric(
            Histogram, "request_latency_seconds", "request arrival to last token", **latency
        )
        self.tokens = metric(Counter, "tokens", "tokens by kind", ["kind"])
        self.routes = metric(
            Counter,
            "routes",
            "requests by path taken (disaggregated, decode_only, fallback)",
            ["route"],
        )
        self.kv_bytes = metric(Counter, "kv_transfer_bytes", "KV bytes moved prefill -> decode")
        self.kv_seconds = metric(
            Histogram,
            "kv_transfer_seconds",
            "time decode spent pulling a request's KV",
            **latency,
        )
        self.kv_transfers = metric(
            Counter, "kv_transfers", "KV hand-overs by result (pulled, recomputed)", ["result"]
        )
        self.failures = metric(Counter, "failures", "failures by kind", ["kind"])
        worker = ["worker", "roles"]
        self.worker_up = metric(
            Gauge, "worker_up", "1 when the worker's last contact succeeded", worker
        )
        self.worker = {
            name: metric(Gauge, "worker_" + name, doc, worker)
            for name, doc in _WORKER_GAUGES.items()
        }
        #: (worker, roles) label pairs of the per-worker series now in the registry.
        self._worker_labels: set[tuple[str, str]] = set()

    def failure(self, kind: str) -> None:
        self.failures.labels(kind).inc()

    def transfer(self, nbytes: int, seconds: float, recomputed: bool) -> None:
        if recomputed:
            self.kv_transfers.labels("recomputed").inc()
            return
        self.kv_transfers.labels("pulled").inc()
        self.kv_bytes.inc(nbytes)
        self.kv_seconds.observe(seconds)

    def render(self, snapshot: list[dict]) -> bytes:
        """The exposition text, with the per-worker series set from `snapshot` (the pool's):
        series of workers no longer in it (dropped, or replaced under a new address after a
        restart) are removed, not left at their last values."""
        current = set()
        for w in snapshot:
            labels = (w["address"], ",".join(w["roles"]))
            current.add(labels)
            self.worker_up.labels(*labels).set(1 if w["healthy"] else 0)
            for name, gauge in self.worker.items():
                if w.get(name) is not None:
                    gauge.labels(*labels).set(w[name])
        for labels in self._worker_labels - current:
            self.remove_worker(*labels)
        self._worker_labels = current
        return generate_latest(self.registry)

    def remove_worker(self, address: str, roles: str) -> None:
        """Drop every per-worker series labelled (address, roles); absent ones are skipped."""
        for gauge in (self.worker_up, *self.worker.values()):
            gauge.remove(address, roles)


class RequestCounter:
    """Pure ASGI middleware (streams pass through untouched): counts responses by
    endpoint and status once the status line is sent."""

    def __init__(self, app, metrics: ProxyMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)
