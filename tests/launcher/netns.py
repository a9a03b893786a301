"""Test hosts: Linux network namespaces joined by veth pairs through a bridge.

    [ns head 172.31.250.1] --veth--+
    [ns pre  172.31.250.2] --veth--+-- bridge (in its own switch namespace)
    [ns dec  172.31.250.3] --veth--+

The addresses exist only inside namespaces this module creates and deletes; nothing is
routed to or from the machine's real interfaces.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time

SUBNET = "172.31.250"


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


class NetnsHosts:
    def __init__(self, names: list[str]) -> None:
        tag = secrets.token_hex(3)
        self.switch = f"hpdsw{tag}"
        self.ns = {name: f"hpd{name[:4]}{tag}" for name in names}
        self.ip = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self._created: list[str] = []
        try:
            self._build(tag)
        except BaseException:
            self.close()
            raise

    def _build(self, tag: str) -> None:
        sh("ip", "netns", "add", self.switch)
        self._created.append(self.switch)
        sw = ["ip", "netns", "exec", self.switch]
        sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
        sh(*sw, "ip", "link", "set", "br0", "up")
        sh(*sw, "ip", "link", "set", "lo", "up")
        for i, (name, ns) in enumerate(self.ns.items()):
            sh("ip", "netns", "add", ns)
            self._created.append(ns)
            host_end, sw_end = f"h{i}{tag}", f"s{i}{tag}"
            sh(
                "ip",
                "link",
                "add",
                host_end,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                sw_end,
                "netns",
                self.switch,
            )
            sh(*sw, "ip", "link", "set", sw_end, "master", "br0")
            sh(*sw, "ip", "link", "set", sw_end, "up")
            run = ["ip", "netns", "exec", ns]
            sh(*run, "ip", "link", "set", "lo", "up")
            sh(*run, "ip", "link", "set", host_end, "name", "eth0")
            sh(*run, "ip", "addr", "add", f"{self.ip[name]}/24", "dev", "eth0")
            sh(*run, "ip", "link", "set", "eth0", "up")

    def cmd(self, name: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[name], *argv]

    def run_checked(self, name: str, *argv: str, env: dict, timeout: float = 180) -> None:
        """Run `argv` on host `name`; a failure raises with the command's own stderr."""
        done = subprocess.run(
            self.cmd(name, *argv), capture_output=True, text=True, timeout=timeout, env=env
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"on {name}: {' '.join(argv[:3])} ... exited {done.returncode}:\n"
                f"{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
            )

    def pids(self) -> list[int]:
        """Every process living in one of this object's namespaces (and only those)."""
        out = []
        for ns in self._created:
            listed = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            out += [int(p) for p in listed if p.isdigit()]
        return out

    def close(self, grace_s: float = 10.0) -> None:
        """Stop the processes in the namespaces (SIGTERM, up to `grace_s` to exit, then
        SIGKILL), then delete the namespaces. Nothing outside them is touched."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
            while pids and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = self.pids()
            if not pids:
                break
        for ns in reversed(self._created):
            sh("ip", "netns", "del", ns, check=False)
        self._created.clear()
