"""`kv_connector_extra_config`, checked once at start-up, and the control-plane secret."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConnectorOptions:
    """`kv_connector_extra_config`, checked: a key this connector does not know, or a value of
    the wrong kind, stops vLLM at start-up with a line naming the key (docs/vllm.md)."""

    control_host: str = "127.0.0.1"
    control_port: int = 0  # 0: any free port
    peers: tuple[str, ...] = ()
    secret_file: str | None = None
    lease_s: float = 120.0
    keep_wait_s: float = 10.0
    timeout_s: float = 30.0
    scatter_gather: bool = True

    def for_rank(self, rank: int) -> ConnectorOptions:
        """The options of tensor-parallel rank `rank`'s worker half: it serves KV control on
        control_port + rank and dials its peers' rank `rank` (their port + rank)."""
        if rank == 0:
            return self
        port = self.control_port + rank if self.control_port else 0
        return dataclasses.replace(
            self, control_port=port, peers=tuple(rank_address(p, rank) for p in self.peers)
        )

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"the hybrid-pd connector takes {', '.join(sorted(known))}"
            )

        def bad(key: str, want: str) -> ValueError:
            return ValueError(f"kv_connector_extra_config.{key} must be {want}, not {extra[key]!r}")

        out: dict[str, Any] = {}
        for key in ("control_host", "secret_file"):
            if key in extra:
                if not isinstance(extra[key], str) or not extra[key]:
                    raise bad(key, "a non-empty string")
                out[key] = extra[key]
        if "control_port" in extra:
            port = extra["control_port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise bad("control_port", "an integer port, 0-65535")
            out["control_port"] = port
        if "peers" in extra:
            peers = extra["peers"]
            if not isinstance(peers, list | tuple) or not all(map(_host_port, peers)):
                raise bad("peers", 'a list of "host:port" control addresses')
            out["peers"] = tuple(peers)
        for key, positive in (("lease_s", True), ("keep_wait_s", False), ("timeout_s", True)):
            if key in extra:
                value = extra[key]
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not math.isfinite(value)
                    or value < 0
                    or (positive and value == 0)
                ):
                    raise bad(key, "a positive number of seconds" if positive else "seconds >= 0")
                out[key] = float(value)
        if "scatter_gather" in extra:
            if not isinstance(extra["scatter_gather"], bool):
                raise bad("scatter_gather", "true or false")
            out["scatter_gather"] = extra["scatter_gather"]
        return cls(**out)


def rank_address(address: str, rank: int) -> str:
    """Where tensor-parallel rank `rank` of the server whose rank 0 serves KV control at
    `address` serves it: the next ports, one per rank."""
    if rank == 0:
        return address
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + rank}"


def _host_port(address: object) -> bool:
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    return bool(host) and port.isdigit()


def read_secret(options: ConnectorOptions) -> str | None:
    path = options.secret_file
    if path:
        with open(path) as f:
            secret = f.read().strip()
        if not secret:
            raise ValueError(f"secret file {path} is empty")
        return secret
    return os.environ.get("HYBRID_PD_SECRET") or None
