"""`hybrid-pd bench serve --schema`: plain and constrained load on one P/D fleet, through the
CLI, with the cost fields its --json prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 100}},
    "required": ["story"],
}
REQUESTS, MAX_TOKENS = 3, 12


def test_bench_serve_schema_json(tmp_path):
    pytest.importorskip("httpx")
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    cmd = [sys.executable, "-m", "hybrid_pd.launcher.cli", "bench", "serve", "--schema", str(path)]
    cmd += ["--concurrency", "1,2", "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS)]
    cmd += ["--prompt-len", "24", "--reps", "2", "--kv-memory", "16MiB", "--json"]
    env = {**os.environ, "HYBRID_PD_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["schema"] == SCHEMA and result["reps"] == 2 and result["no_leaks"]
    assert result["errors"] == 0
    assert set(result["setups"]) == {"plain", "schema"}
    for v, rows in result["setups"].items():
        assert [r["concurrency"] for r in rows] == [1, 2]
        for r in rows:
            # the schema's string outlasts max_tokens: both run to it
            assert r["completed"] == REQUESTS and r["output_tokens_per_request"] == MAX_TOKENS
            assert r["itl_ms_p50"] > 0 and r["output_tokens_per_s"] > 0, (v, r)
    for c in result["costs"]:
        assert isinstance(c["schema_cost_per_token"], float)
        assert isinstance(c["schema_cost_throughput"], float)
        assert len(c["per_rep_cost_per_token"]) == 2
    assert isinstance(result["schema_cost_per_token_median"], float)
    # warm-up included: every request took the prefill worker
    assert result["routes"] == {"disaggregated": 2 * (2 + 2 * 2 * REQUESTS)}
