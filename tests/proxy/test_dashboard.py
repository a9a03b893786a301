"""deploy/grafana-dashboard.json: valid JSON in Grafana's dashboard shape, and every metric
its queries name is one the proxy's /metrics really exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hybrid_pd.proxy.metrics import ProxyMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


def exposed_names() -> set[str]:
    """Sample names in the proxy's /metrics text once every labelled series has a child and
    one worker is known (labelled counters without children expose no samples)."""
    m = ProxyMetrics()
    m.requests.labels("/v1/completions", "200").inc()
    m.tokens.labels("prompt").inc(3)
    m.routes.labels("disaggregated").inc()
    m.failure("migrated")
    m.transfer(1024, 0.01, recomputed=False)
    worker = {
        "address": "127.0.0.1:1",
        "roles": ["decode"],
        "healthy": True,
        "num_blocks": 10,
        "free_blocks": 9,
        "running": 0,
        "waiting": 0,
        "outstanding_prefill_tokens": 0,
        "outstanding_decodes": 0,
    }
    text = m.render([worker]).decode()
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line[:1] != "#"}


def queries(dashboard: dict) -> list[str]:
    out = []
    for panel in dashboard["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["definition"])
    return out


def test_dashboard_is_valid_and_names_only_metrics_the_proxy_exposes():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert (
            set(p["gridPos"]) == {"x", "y", "w", "h"}
            and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        )
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    exprs = queries(dashboard)
    named = {n for e in exprs for n in re.findall(r"\bhybrid_pd_\w+", e)}
    exposed = exposed_names()
    assert named and not named - exposed, sorted(named - exposed)
    # What an operator needs first is on it.
    for needed in (
        "hybrid_pd_proxy_requests_total",
        "hybrid_pd_proxy_time_to_first_token_seconds_bucket",
        "hybrid_pd_proxy_routes_total",
        "hybrid_pd_proxy_failures_total",
        "hybrid_pd_proxy_worker_up",
        "hybrid_pd_proxy_worker_free_blocks",
    ):
        assert needed in named, needed
