"""`hybrid-pd serve --engine vllm --address`: a Ray cluster of three hosts (head, prefill
node, decode node), each in its own network namespace joined by veth pairs and given a CPU
of its own. The vLLM servers run on the worker nodes, KV crosses between hosts over UCX
(TCP), and the proxy's answers equal one vLLM instance's."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys

import pytest

from tests.launcher.netns import NetnsHosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or len(os.sched_getaffinity(0)) < 2,
        reason="needs root, iproute2 and two CPUs to create test hosts",
    ),
]


def test_vllm_pools_on_a_cluster(tmp_path):
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {
        **os.environ,
        "HYBRID_PD_CACHE": str(tmp_path),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),  # the cluster's own, not ~/.ray's
        "HYBRID_PD_SECRET": secrets.token_urlsafe(32),
    }
    cpus = sorted(os.sched_getaffinity(0))
    hosts = NetnsHosts(["head", "prefill", "decode"])
    head = f"{hosts.ip['head']}:6379"
    try:
        starts = [
            ("head", cpus[0], ["--head", "--port", "6379", "--num-cpus", "1",
                               "--resources", "{}", "--include-dashboard", "false"]),
            ("prefill", cpus[0], ["--address", head, "--num-cpus", "1",
                                  "--resources", json.dumps({"prefill": 1})]),
            ("decode", cpus[1], ["--address", head, "--num-cpus", "1",
                                 "--resources", json.dumps({"decode": 1})]),
        ]  # fmt: skip
        for name, cpu, extra in starts:
            # A host's CPUs: the vLLM server on the node binds what its node gives it.
            hosts.run_checked(
                name, "taskset", "-c", str(cpu), ray_bin, "start", "--node-ip-address",
                hosts.ip[name], "--disable-usage-stats", *extra, env=env,
            )  # fmt: skip
        proc = subprocess.run(
            hosts.cmd("head", sys.executable, "-m", "tests.vllm_connector.multinode_scenario",
                      "--address", head, "--root", str(tmp_path),
                      "--decode-netns", hosts.ns["decode"]),
            capture_output=True, text=True, timeout=900, env=env, cwd=os.getcwd(),
        )  # fmt: skip
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and lines, proc.stderr[-4000:]
        result = json.loads(lines[-1])
        assert result["distinct"], "random weights too flat to tell"
        assert result["equal"], result
        assert result["disaggregated"] == [3.0] and result["pulls"] == 3.0, result
        # The workers really live on the other hosts.
        assert result["addresses"]["prefill"][0].startswith(hosts.ip["prefill"] + ":")
        assert result["addresses"]["decode"][0].startswith(hosts.ip["decode"] + ":")
    finally:
        hosts.close()  # only this test's processes: those inside its namespaces
