"""`hybrid-pd serve` on embedded Ray, in a network namespace of its own (loopback only)."""

from __future__ import annotations

import json
import os
import re
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
    assert not result["ray_open"], "embedded Ray answered a caller without its token"
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


def access_fields(line: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in line.split(" hybrid_pd.access: ", 1)[1].split()[2:])


def test_serve_command_console_access_log_and_sigterm(tmp_path):
    """One `hybrid-pd serve` process: what it says while it starts, a worker's own line
    forwarded under its name, the access log, and SIGTERM: a stream in flight finishes,
    new connections are refused, exit status 0 without a traceback."""
    r = run_in_netns(
        "tests.launcher.serve_cli_scenario",
        240,
        {"HYBRID_PD_CACHE": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"},
    )
    err = r["stderr"]
    text = "\n".join(err)
    assert r["returncode"] == 0, text
    assert "Traceback" not in text and "SIGTERM received at" not in text, text
    assert r["stdout"] == [
        "hybrid-pd serving tiny at http://127.0.0.1:8000/v1 (1 prefill, 1 decode workers)"
    ]

    def first(pattern: str) -> tuple[int, re.Match]:
        for i, line in enumerate(err):
            if m := re.search(pattern, line):
                return i, m
        raise AssertionError(f"no line matches {pattern!r}:\n{text}")

    serve_log = r"INFO hybrid_pd\.launcher\.serve: "
    ray_up, _ = first(serve_log + r"Ray: started an embedded local instance at 127\.0\.0\.1:\d+")
    for role in ("prefill", "decode"):
        loading, _ = first(serve_log + f"{role}-0: starting, loading model tiny$")
        ready, m = first(
            serve_log + f"{role}-0: ready at (127\\.0\\.0\\.1:\\d+) \\(engine {role}-\\w+\\), "
            r"KV cache (\d+) blocks x (\d+) tokens = (\d+) token slots$"
        )
        blocks, size, slots = int(m[2]), int(m[3]), int(m[4])
        assert ray_up < loading < ready and blocks > 0 and slots == blocks * size
        # The worker's own logging, forwarded by Ray under the worker's name.
        first(
            rf"^\({role}-0 pid=\d+\) .* INFO hybrid_pd\.workers\.worker: {role} worker "
            rf"{role}-\w+ serving on {re.escape(m[1])}$"
        )
    proxy_up, _ = first(serve_log + r"proxy: listening on http://127\.0\.0\.1:8000 ")

    _, m = first(r"hybrid_pd\.access: POST /v1/completions status=200 id=" + r["completion_id"])
    line = access_fields(m.string)
    assert line["route"] == "disaggregated"  # the prompt is long enough for the prefill pool
    assert int(line["prompt_tokens"]) == r["prompt_tokens"] > 32
    assert int(line["output_tokens"]) == r["completion_tokens"] == 8
    assert 0 < float(line["ttft_ms"]) <= float(line["total_ms"])

    # SIGTERM during the stream: the stream ran to its end, then serve stopped, status 0.
    stopping, _ = first(serve_log + "stopping: no new connections")
    streamed, m = first(r"hybrid_pd\.access: POST /v1/completions status=200 .*output_tokens=48 ")
    assert proxy_up < stopping < streamed < first(serve_log + "stopped$")[0]
    assert r["stream_done"] and r["stream_status"] == 200 and r["new_connection_refused"]
    assert r["exit_after_sigterm_s"] < 60
