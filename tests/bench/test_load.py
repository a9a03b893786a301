"""`hybrid-pd bench load`: the request mix, the accounting, and one quick run of `serve` in a
private network namespace (the bench makes it itself)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hybrid_pd.bench.load.mix import Outcome, make_mix, make_request, summarize


def _text(r) -> str:
    return r.body["prompt"] if "prompt" in r.body else r.body["messages"][0]["content"]


def test_mix_is_seeded_and_mixed():
    a = make_mix("tiny", "s-mix0", 200)
    assert a == make_mix("tiny", "s-mix0", 200)
    assert make_request("tiny", "s-mix0", 7) == a[7]  # any prefix of the mix is the same
    assert a != make_mix("tiny", "s-mix1", 200)
    paths = {r.path for r in a}
    assert paths == {"/v1/completions", "/v1/chat/completions"}
    assert {r.stream for r in a} == {True, False}
    for r in a:
        assert 10 <= len(_text(r)) <= 2000
        assert 1 <= r.body["max_tokens"] <= 64 and r.body["temperature"] == 0
        assert r.body["stream"] == r.stream and ("stream_options" in r.body) == r.stream
    long = make_mix("tiny", "s-kv", 20, chars=(1425, 1575), stream=True)
    assert all(r.stream and 1425 <= len(_text(r)) <= 1575 for r in long)


def test_summary_accounts_for_every_request():
    outs = [
        Outcome(0, True, 0.0, 1.0, ok=True, ttft=0.25, tokens=4),
        Outcome(1, False, 0.0, 2.0, ok=True, tokens=6),
        Outcome(2, False, 0.0, 0.5, kind="503", answered=True),
        Outcome(3, True, 0.0, 3.0, kind="stream_incomplete"),
    ]
    s = summarize(5, outs, 4.0)
    assert (s["sent"], s["not_sent"], s["completed"], s["failed"], s["lost"]) == (4, 1, 2, 2, 1)
    assert s["failed_by_kind"] == {"503": 1, "stream_incomplete": 1}
    assert s["output_tokens"] == 10 and s["output_tokens_per_s"] == 2.5
    assert s["ttft_ms_p50"] == 250.0  # streaming requests only
    assert s["e2e_ms_p50"] == 1500.0  # completed requests only


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0,
    reason="needs root, unshare and ip for a private network namespace",
)
def test_bench_load_quick_mixed_pd(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "hybrid_pd.launcher.cli",
        "bench",
        "load",
        "--quick",
        "--json",
        "--scenarios",
        "mixed",
        "--modes",
        "pd",
        "--requests",
        "24",
        "--verify",
        "2",
        "--time-limit-s",
        "100",
    ]
    env = {**os.environ, "HYBRID_PD_CACHE": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert set(result) == {"pd", "meta"} and set(result["pd"]) == {"mixed"}
    assert result["meta"]["netns"] is True
    mixed = result["pd"]["mixed"]
    assert "error" not in mixed, mixed
    assert mixed["serve"]["prefill"] == 1 and mixed["serve"]["decode"] == 1
    (level,) = mixed["levels"]
    assert level["concurrency"] == 16 and level["requests"] == 24
    # Failures are reported, not asserted away; but no request may go unaccounted.
    assert level["completed"] + level["failed"] == level["sent"]
    assert level["sent"] + level["not_sent"] == level["requests"]
    assert sum(level["failed_by_kind"].values()) == level["failed"]
    assert 0 <= level["lost"] <= level["failed"]
    for key in ("requests_per_s", "output_tokens_per_s", "ttft_ms_p50", "e2e_ms_p99"):
        assert key in level
    v = mixed["verify"]
    assert v["compared"] + v["unchecked"] == len(v["indexes"]) == 2
    assert 0 <= v["mismatched"] <= v["compared"]
    assert sorted(r for w in mixed["workers"] for r in w["roles"]) == ["decode", "prefill"]
    for w in mixed["workers"]:
        assert {"num_blocks", "free_blocks", "leases", "leaked_blocks", "clean"} <= set(w)
