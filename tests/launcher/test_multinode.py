"""A Ray cluster of three hosts (head, prefill node, decode node), each in its own network
namespace joined by veth pairs: 50 concurrent requests through the proxy, all correct, KV
crossing between hosts, no block leaked on any worker."""

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
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs root and iproute2 to create test hosts",
    ),
]


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_multinode_cluster_50_concurrent_requests(tmp_path, prefill_tp):
    """`prefill_tp` 2: the prefill worker is a tensor-parallel group of two ranks on the
    prefill host, handing KV to a one-rank decode worker on the other host."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {
        **os.environ,
        "HYBRID_PD_CACHE": str(tmp_path),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        # The cluster's own token, given to every node and the driver (nothing in ~/.ray:
        # a fresh machine has none there, and the test leaves the user's files alone).
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        # Joining a cluster needs a control-plane secret: the driver reads it from here.
        "HYBRID_PD_SECRET": secrets.token_urlsafe(32),
    }
    hosts = NetnsHosts(["head", "prefill", "decode"])
    head = f"{hosts.ip['head']}:6379"
    try:
        starts = [
            (
                "head",
                [
                    "--head",
                    "--port",
                    "6379",
                    "--num-cpus",
                    "1",
                    "--resources",
                    "{}",
                    "--include-dashboard",
                    "false",
                ],
            ),
            (
                "prefill",
                ["--address", head, "--num-cpus", "1", "--resources", json.dumps({"prefill": 1})],
            ),
            (
                "decode",
                ["--address", head, "--num-cpus", "1", "--resources", json.dumps({"decode": 1})],
            ),
        ]
        for name, extra in starts:
            hosts.run_checked(
                name,
                ray_bin,
                "start",
                "--node-ip-address",
                hosts.ip[name],
                "--disable-usage-stats",
                *extra,
                env=env,
            )
        proc = subprocess.run(
            hosts.cmd(
                "head",
                sys.executable,
                "-m",
                "tests.launcher.multinode_scenario",
                "--address",
                head,
                "--requests",
                "50",
                "--prefill-tp",
                str(prefill_tp),
            ),
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
            cwd=os.getcwd(),
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and lines, proc.stderr[-4000:]
        result = json.loads(lines[-1])
        assert result["correct"] == 50
        # Workers really live on the other hosts, and KV crossed between them.
        assert result["nodes"]["prefill-0"].startswith(hosts.ip["prefill"] + ":")
        assert result["nodes"]["decode-0"].startswith(hosts.ip["decode"] + ":")
        assert result["kv_bytes_moved"] > 0, result
        assert all(v == 0 for v in result["leaked"].values()), result["leaked"]
        assert result["tp"] == {"prefill-0": prefill_tp, "decode-0": 1}
    finally:
        # Only this test's Ray: the processes inside its namespaces (never `ray stop`, which
        # reaches every Ray instance on the machine).
        hosts.close()
