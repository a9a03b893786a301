"""`hybrid-pd bench serve --peer vllm`: our proxy and worker next to vLLM's OpenAI server on
one small checkpoint: every request served on both sides, greedy ids equal (fp32), the
figures' shape, and no KV block left on our worker."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from hybrid_pd.bench.cli import add_bench
from tests.vllm_connector import checkpoints

pytestmark = pytest.mark.slow


def test_bench_serve_against_vllm(tmp_path, capsys):
    model = checkpoints.gemma3(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "serve", "--peer", "vllm", "--peer-python", sys.executable, "--model",
         str(model), "--concurrency", "1,3", "--requests", "4", "--prompt-len", "24",
         "--max-tokens", "5", "--reps", "2", "--threads", "1", "--max-seconds", "600",
         "--json"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peer"] == "vllm" and out["reps"] == 2 and out["dtype"] == "float32"
    assert out["errors"] == 0 and out["no_leaks"]
    assert out["peer_log"] is None  # vLLM's log is kept only where something failed
    assert out["max_num_seqs"] == 3
    for side in ("ours", "vllm"):
        rows = out["setups"][side]
        assert [r["concurrency"] for r in rows] == [1, 3]
        for r in rows:
            assert r["completed"] == 4 and r["errors"] == 0
            assert r["output_tokens"] == 4 * 5
            assert r["output_tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0
        assert len(out["reps_rows"][side]) == 2
        assert all("token_ids" not in r for rows in out["reps_rows"][side] for r in rows)
    # both levels of the first repetition, 4 requests each, the same greedy ids
    assert out["greedy"] == {"compared": 8, "equal": 8, "differing": []}
    for r in out["ratios"]:
        assert r["output_tokens_per_s"] > 0 and len(r["output_tokens_per_s_reps"]) == 2
