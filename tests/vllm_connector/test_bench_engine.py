"""`hybrid-pd bench engine --peer vllm`: our engine and vLLM's on one small checkpoint, with
the figures' shape and the greedy tokens of both sides (fp32: they must be equal)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

from hybrid_pd.bench.cli import add_bench
from tests.vllm_connector import checkpoints

pytestmark = pytest.mark.slow


def test_bench_engine_against_vllm(tmp_path, capsys):
    """With --confine-peer: every vLLM process, not only its model worker, on the bench CPUs
    (its front end reports where it may run); this process's own CPUs come back after."""
    model = checkpoints.granite_hybrid(tmp_path / "ckpt")
    affinity = os.sched_getaffinity(0)
    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "engine", "--model", str(model), "--peer", "vllm", "--peer-python",
         sys.executable, "--batch-sizes", "1,2", "--prompt-len", "40", "--decode-tokens", "4",
         "--reps", "2", "--threads", "1", "--dtype", "float32", "--confine-peer",
         "--decode-by-difference", "--json"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peer"] == "vllm" and out["reps"] == 2 and out["vllm_mode"] == "eager"
    assert out["decode_by_difference"] is True
    assert out["dtype"] == {"ours": "float32", "vllm": "float32"}
    assert out["threads"]["ours"] == out["threads"]["vllm"] == 1
    assert out["threads"]["vllm_processes_cpus"] == out["threads"]["cpus"]
    assert len(out["threads"]["cpus"]) == 1
    assert os.sched_getaffinity(0) == affinity
    assert out["versions"]["vllm"] and out["versions"]["torch"]
    assert [r["batch_size"] for r in out["runs"]] == [1, 2]
    for r in out["runs"]:
        for side in ("ours", "vllm"):
            for phase in ("prefill", "decode"):
                assert r[f"{side}_{phase}_tokens_per_s"] > 0
                reps = r[f"{side}_{phase}_tokens_per_s_reps"]
                assert len(reps) == 2 and min(reps) > 0
        assert r["prefill_ratio"] > 0 and r["decode_ratio"] > 0 and r["wall_ratio"] > 0
        for side in ("ours", "vllm"):
            walls = r[f"{side}_wall_s_reps"]
            assert len(walls) == 2 and min(walls) > 0
            for key in ("prefill_alone", "decode_by_difference"):
                assert len(r[f"{side}_{key}_tokens_per_s_reps"]) == 2
                assert r[f"{side}_{key}_tokens_per_s"] > 0
        assert r["decode_by_difference_ratio"] > 0
        ours, theirs = r["ours_token_ids_rep0"], r["vllm_token_ids_rep0"]
        assert len(ours) == r["batch_size"] and all(len(ids) == 4 for ids in ours)
        assert ours == theirs, (ours, theirs)
        assert r["greedy_equal_sequences"] == r["batch_size"]


def test_missing_peer_python_names_the_flag(monkeypatch):
    from hybrid_pd.bench.peer import peer_python

    monkeypatch.delenv("HYBRID_PD_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit, match="--peer-python"):
        peer_python(None)
