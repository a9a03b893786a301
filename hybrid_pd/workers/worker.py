"""A worker: engine loop + connector role + gRPC (Worker and KVControl) on one port.

Plain class, testable without Ray; the Ray actor (launcher) is a thin shell over it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from hybrid_pd.connector.control import KVControlServicer, make_server
from hybrid_pd.connector.decode import DecodeConnector
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.prefill import DEFAULT_LEASE_S, PrefillConnector
from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.engine.tiny import resolve_model
from hybrid_pd.proto import kv_control_pb2_grpc, worker_pb2_grpc
from hybrid_pd.workers.service import WorkerServicer

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    device: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    secret: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    failure_policy: str = "recompute"  # or "fail"
    transfer_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    #: UCX transports (UCX_TLS syntax, e.g. "tcp,self"); None: UCX's choice.
    ucx_tls: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError("failure policy must be 'recompute' or 'fail'")
        if self.lease_s <= 0:
            raise ValueError("lease must be positive")


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        from hybrid_pd.connector.ucx_transport import UcxTransport

        self.config = config
        self.engine_id = f"{config.role}-{uuid.uuid4().hex[:10]}"
        model, hf_config, tokenizer = load_model(resolve_model(config.model), config.device)
        self.model_name = config.model
        engine = Engine(model, hf_config, config.engine, tokenizer)
        self.layout = KVLayout.of(engine.kv_config, _model_identity(hf_config, model))
        ucx = ucx_options_for(config.host)
        if config.ucx_tls:
            ucx["TLS"] = config.ucx_tls
        self.transport = UcxTransport(ucx_options=ucx)
        self.transport.start()
        self.server, self.port = make_server(f"{config.host}:{config.port}", config.secret)
        self.address = f"{config.host}:{self.port}"
        self.prefill: PrefillConnector | None = None
        self.decode: DecodeConnector | None = None
        if config.role in ("prefill", "both"):
            self.prefill = PrefillConnector(
                engine_id=self.engine_id,
                layout=self.layout,
                control_address=self.address,
                free_blocks=self._free_kept,
                region=engine.pool.region,
                transport=self.transport,
                lease_s=config.lease_s,
            )
        engine.connector = self.prefill
        self.engine = engine
        self.loop = EngineLoop(self.engine)
        if self.prefill is not None:
            self.loop.add_hook(self.prefill.expire)
        if config.role in ("decode", "both"):
            self.decode = DecodeConnector(
                engine_id=self.engine_id,
                layout=self.layout,
                transport=self.transport,
                region=self.engine.pool.region,
                secret=config.secret,
                timeout_s=config.transfer_timeout_s,
            )
        kv_control_pb2_grpc.add_KVControlServicer_to_server(
            KVControlServicer(self.engine_id, self.layout, self.transport.address, self.prefill),
            self.server,
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(self), self.server)
        self.started_at = time.time()
        self.server.start()
        logger.info("%s worker %s serving on %s", config.role, self.engine_id, self.address)

    def _free_kept(self, request_id: str) -> None:
        self.loop.call(self.engine.free_request_blocks, request_id)

    def stats(self) -> dict:
        def collect() -> dict:
            kv = self.engine.kv
            kv.check_integrity()
            return {
                "engine_id": self.engine_id,
                "role": self.config.role,
                "address": self.address,
                "model": self.model_name,
                "num_blocks": kv.pool.num_blocks,
                "free_blocks": kv.pool.num_free_blocks,
                "cached_blocks": kv.pool.num_cached_blocks,
                "kv_requests": kv.num_requests,
                "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting),
                "page_size_bytes": self.layout.page_size_bytes,
                "block_size": self.layout.block_size,
                "integrity": "ok",
            }

        out = self.loop.call(collect)
        if self.prefill is not None:
            out["leases"] = self.prefill.num_leases
            out["prefill_connector"] = dict(self.prefill.stats)
        if self.decode is not None:
            out["decode_connector"] = dict(self.decode.stats)
        out["transport"] = self.transport.stats()
        return out

    def close(self) -> None:
        self.server.stop(grace=1.0).wait(5)
        self.loop.stop()
        if self.prefill is not None:
            self.prefill.close()
        if self.decode is not None:
            self.decode.close()
        self.transport.close()


def ucx_options_for(host: str) -> dict[str, str]:
    """UCX devices matching the gRPC address: loopback for a loopback worker, else the
    interface that owns `host` (UCX would otherwise also advertise loopback, which a peer on
    another host cannot reach). UCX_NET_DEVICES in the environment wins. Shared memory
    still carries same-host transfers."""
    if os.environ.get("UCX_NET_DEVICES"):
        return {}
    if host in ("127.0.0.1", "localhost", "::1"):
        return {"NET_DEVICES": "lo"}
    iface = interface_of(host)
    return {"NET_DEVICES": iface} if iface else {}


def interface_of(ip: str) -> str | None:
    """Name of the local network interface holding IPv4 address `ip` (Linux), or None."""
    import fcntl
    import socket
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                continue
            if addr == ip:
                return name
    return None


def _model_identity(hf_config: dict, model) -> str:
    """Architecture, size and a checksum of the first weights: peers must serve one model."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    params = list(model.parameters())
    head = params[0].detach().flatten()[:4096].float().cpu().numpy().tobytes()
    digest = hashlib.sha256(head).hexdigest()[:16]
    n = sum(p.numel() for p in params)
    return json.dumps({"architecture": arch, "parameters": n, "weights": digest}, sort_keys=True)
