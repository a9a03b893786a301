"""`hybrid-pd bench overlap` on the tiny model: the same prompts' hand-over with overlap off
and on, alternating; staged bytes only with it on; both workers clean at the end."""

from __future__ import annotations

import pytest

from hybrid_pd.bench.overlap import bench_overlap

pytestmark = pytest.mark.slow


def test_bench_overlap_reports_both_modes(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_PD_CACHE", str(tmp_path))
    # Slowed prefill steps: the decode worker sees each chunk before the next one.
    slow = {"HYBRID_PD_INJECT_FAULT": "slow_prefill:0.03", "HYBRID_PD_CACHE": str(tmp_path)}
    out = bench_overlap(
        "tiny", prompt_len=512, chunk=64, reps=2, kv_memory="64MiB", env=slow, concurrency=2
    )
    runs = out["runs"]
    assert [r["mode"] for r in runs] == ["off", "on", "on", "off"]  # alternating
    for r in runs:
        assert 0 < r["first_s"] < r["second_s"] <= r["done_s"] and r["wait_s"] > 0
    # The decode worker's counters after each run: staged bytes grow only with overlap on.
    staged = [r["staged_bytes_total"] for r in runs]
    assert staged[0] == 0 and staged[1] > 0 and staged[2] > staged[1] and staged[3] == staged[2]
    assert all(r["bytes_total"] > s for r, s in zip(runs, staged, strict=True))
    s = out["summary"]
    assert s["wait_ratio"] == round(s["on"]["wait_s"] / s["off"]["wait_s"], 3)
    assert all(w["clean"] for w in out["workers"]), out["workers"]
    with pytest.raises(ValueError, match="max_tokens"):
        bench_overlap("tiny", max_tokens=1)
