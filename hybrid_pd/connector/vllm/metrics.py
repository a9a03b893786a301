"""The connector's counters: vLLM's stats object and Prometheus counters for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: Counters a worker reports (deltas per engine step; vLLM sums them for its log line and
#: the connector's Prometheus counters, `hybrid_pd_kv_<name>_total`).
COUNTERS = {
    "pulls": "KV pulls completed on this decode server",
    "pull_failures": "KV pulls that failed (the request follows kv_load_failure_policy)",
    "bytes_pulled": "bytes of KV received",
    "messages_pulled": "UCX messages of KV received",
    "pull_seconds": "seconds spent in successful pulls (control calls and transfer)",
    "handed_over": "requests whose KV this prefill server kept for a decode server",
    "pulled_from": "KV pulls this prefill server served",
    "bytes_sent": "bytes of KV sent (or read one-sided by the decode server)",
    "read_pulls": "KV pulls a decode server read one-sided from this prefill server",
    "released": "kept requests released after their pull",
    "expired": "kept requests freed because no decode server pulled them in time",
    "aborted": "kept requests dropped by their decode server",
}


@dataclass
class HybridPDStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> HybridPDStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items() if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HybridPDPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(
                name=f"hybrid_pd_kv_{name}", documentation=doc, labelnames=labelnames
            )
            self.counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if value and name in self.counters and engine_idx in self.counters[name]:
                self.counters[name][engine_idx].inc(value)
