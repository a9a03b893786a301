"""`hybrid-pd bench serve` on the tiny model: both setups, two concurrency levels, a plot."""

from __future__ import annotations

import json

import pytest

from hybrid_pd.bench.completions import _pct
from hybrid_pd.bench.serve import bench_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REQUESTS, MAX_TOKENS, LEVELS = 4, 4, (1, 2)


def test_percentile():
    assert _pct([], 50) is None
    assert _pct([3.0], 90) == 3.0
    assert _pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert _pct([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_bench_serve_pd_and_aggregated(tmp_path, monkeypatch):
    pytest.importorskip("httpx")
    monkeypatch.setenv("HYBRID_PD_CACHE", str(tmp_path / "cache"))
    png = tmp_path / "serve.png"
    result = bench_serve(
        "tiny",
        LEVELS,
        requests=REQUESTS,
        max_seconds=60,
        prompt_len=40,
        max_tokens=MAX_TOKENS,
        plot=str(png),
        kv_memory="16MiB",
        env={"HYBRID_PD_CACHE": str(tmp_path / "cache")},
    )
    json.dumps(result)  # serializable as printed by --json
    assert result["model"] == "tiny"
    assert (result["prompt_len"], result["max_tokens"]) == (40, MAX_TOKENS)
    assert set(result["setups"]) == {"pd", "aggregated"}
    for setup, rows in result["setups"].items():
        assert [r["concurrency"] for r in rows] == list(LEVELS)
        for r in rows:
            assert r["completed"] == r["launched"] == REQUESTS, (setup, r)
            assert r["errors"] == 0, (setup, r)
            assert r["output_tokens"] == REQUESTS * MAX_TOKENS, (setup, r)
            for key in (
                "ttft_ms_p50",
                "ttft_ms_p90",
                "itl_ms_p50",
                "itl_ms_p90",
                "e2e_ms_p50",
                "output_tokens_per_s",
                "requests_per_s",
            ):
                assert r[key] is not None and r[key] > 0, (setup, key, r)
            assert r["ttft_ms_p50"] <= r["ttft_ms_p90"] and r["ttft_ms_p50"] < r["e2e_ms_p50"]
    # Warm-up included: every P/D request was disaggregated, no aggregated one was.
    total = REQUESTS * len(LEVELS) + 1
    assert result["routes"]["pd"] == {"disaggregated": total}
    assert result["routes"]["aggregated"] == {"decode_only": total}
    assert [r["concurrency"] for r in result["ratios"]] == list(LEVELS)
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 for r in result["ratios"])
    assert [w["role"] for w in result["workers"]["pd"]] == ["prefill", "decode"]
    assert [w["role"] for w in result["workers"]["aggregated"]] == ["both"]
    for w in (*result["workers"]["pd"], *result["workers"]["aggregated"]):
        assert w["clean"] and w["leaked_blocks"] == 0 and w["kv_requests"] == 0, w
        assert w["leases"] == 0, w
    assert result["no_leaks"]
    if result["plot"] is None:
        pytest.skip("matplotlib is not installed: the plot was skipped")
    assert png.exists() and png.stat().st_size > 0
