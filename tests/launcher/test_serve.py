"""`hybrid-pd serve` on embedded Ray, in a network namespace of its own (loopback only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("unshare") is None or os.geteuid() != 0,
        reason="needs root and unshare for a private network namespace",
    ),
]


def run_in_netns(module: str, timeout: float, env: dict) -> dict:
    cmd = [
        "unshare",
        "-n",
        "--",
        "sh",
        "-c",
        f"ip link set lo up && exec {sys.executable} -m {module}",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_serve_embedded_ray_openai_client_and_restart(tmp_path):
    result = run_in_netns(
        "tests.launcher.serve_scenario",
        420,
        {"HYBRID_PD_CACHE": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert result["completion_ok"] and result["stream_ok"]
    # No --secret given: the workers are closed all the same.
    assert not result["prefill_open"] and not result["decode_open"], result
    assert (result["prefill_role"], result["decode_role"]) == ("prefill", "decode")
    assert result["restarted"] and result["after_restart_ok"]
    assert all(v == 0 for v in result["leaked"].values()), result["leaked"]


def test_serve_recreates_a_lost_worker_then_gives_up(tmp_path):
    result = run_in_netns(
        "tests.launcher.serve_recreate_scenario",
        180,
        {"HYBRID_PD_CACHE": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert result["secret_set"]
    assert result["recreated"] and not result["failed_after_first"], result
    assert result["after_recreate_status"] == 200, result
    assert result["failed"], result
    failure = result["failure"]
    assert failure.startswith("the decode pool cannot be restored: decode-0 is dead for good")
    assert "all 1 re-creations spent" in failure and "\n" not in failure
    assert result["callback"] == [failure]


def test_lm_eval_scores_over_pd_equal_one_engine(tmp_path):
    """lm-evaluation-harness (`local-completions`: loglikelihood with echo + logprobs, and
    generate-until) against serve's P/D path, and against one engine in-process: equal."""
    result = run_in_netns(
        "tests.launcher.lm_eval_scenario",
        420,
        {
            "HYBRID_PD_CACHE": str(tmp_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        },
    )
    assert result["routes"] == {"disaggregated": 44.0}, result["routes"]  # every request P/D
    assert result["documents"] == {"hpd_choice": 12, "hpd_until": 8}
    assert result["pd"] == result["single"], result
    assert result["loglikelihood_max_diff"] <= 1e-5, result
    assert result["greedy_flags_equal"] and result["generations_equal"], result
    assert result["generations_vary"], "the random model answers every prompt alike"
