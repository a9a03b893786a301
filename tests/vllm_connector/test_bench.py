"""`hybrid-pd bench vllm` end to end with hybrid-pd's connector (NIXL needs the `nixl`
package, which this environment need not have; the bench's NIXL side is exercised by hand,
see docs/vllm.md)."""

from __future__ import annotations

import argparse
import sys

import pytest

from hybrid_pd.bench.vllm_pd import add_bench_vllm, bench_vllm
from tests.vllm_connector import checkpoints

pytestmark = pytest.mark.slow


def test_bench_reports_exact_hand_offs_and_what_moved(tmp_path):
    model = checkpoints.granite_hybrid(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_bench_vllm(parser.add_subparsers())
    args = parser.parse_args(
        ["vllm", "--model", str(model), "--python", sys.executable, "--connectors",
         "hybrid-pd", "--reps", "2", "--max-tokens", "6",
         "--prompt-lens", "40,300", "--prompts", "1", "--log-dir", str(tmp_path / "logs")]
    )  # fmt: skip
    out = bench_vllm(args)
    ours = out["connectors"]["hybrid-pd"]
    assert ours["requests"] == 4
    assert ours["exact"] == 4 and ours["mean_agreeing_tokens"] == 6
    moved = ours["decode_transfer_metrics"]
    assert moved["hybrid_pd_kv_pulls_total"] == 4
    assert moved["hybrid_pd_kv_pull_failures_total"] == 0
    assert moved["hybrid_pd_kv_bytes_pulled_total"] > 0
    assert moved["hybrid_pd_kv_pull_seconds_total"] > 0
    assert [r["rep"] for r in ours["per_request"]] == [0, 0, 1, 1]
    assert all(r["decode_ttft_s"] > 0 for r in ours["per_request"])
    assert out["prompt_lens"] == [40, 300]
    # the servers' timeline: every stage of each hand-off, per prompt length
    for n in ("40", "300"):
        fig = ours["handoff"][n]
        assert fig["decode_ttft_s"]["n"] == 2
        assert fig["handoff_s"]["n"] == 2 and 0 < fig["handoff_s"]["p50"] <= fig["handoff_s"]["p99"]
        assert 0 < fig["pull_s"]["p50"] < fig["handoff_s"]["max"]
        stages = fig["stages_ms_p50"]
        # a one-sided pull (the default): decode reads, the prefill server confirms
        for stage in ("kept", "decode_arrived", "reads_posted", "reads_done", "read_confirmed",
                      "bytes_arrived", "reported", "finished_seen", "first_step"):  # fmt: skip
            assert stages[stage] >= 0, stage
    assert all(r["handoff_s"] > r["pull_s"] > 0 for r in ours["per_request"])
