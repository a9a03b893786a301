"""`hybrid-pd serve --engine vllm`: vLLM pools under Ray behind hybrid-pd's proxy."""

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


def test_serve_engine_vllm_equals_one_instance(tmp_path):
    cmd = [
        "unshare",
        "-n",
        "--",
        "sh",
        "-c",
        f"ip link set lo up && exec {sys.executable} -m tests.vllm_connector.serve_scenario",
    ]
    env = {**os.environ, "HYBRID_PD_CACHE": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert result["distinct"], "random weights too flat to tell"
    assert result["equal"], result
    assert result["disaggregated"] == [3.0] and result["pulls"] == 3.0, result
