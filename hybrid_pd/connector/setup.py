"""One set-up of a worker's KV planes, used by our worker (`workers/worker.py`) and by the
worker half of the vLLM connector (`connector/vllm/worker.py`):

    transport = start_transport(host, tls)              UCX, on the devices that match `host`
    server, address = open_server(host, port, secret)   the gRPC server KVControl runs on
    ...  (make the prefill half, which needs `address`)
    add_kv_control(server, engine_id, layout, transport, prefill)
    server.start()

The caller owns what it gets: it starts the server (after adding its own services, if any)
and stops the server and closes the transport when it closes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hybrid_pd.connector.control import AioServer, KVControlServicer
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.ucx import UcxTransport
from hybrid_pd.kvcache.ids import EngineId
from hybrid_pd.proto import kv_control_pb2_grpc

if TYPE_CHECKING:
    from hybrid_pd.connector.prefill import PrefillConnector


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


def start_transport(host: str, tls: str | None = None) -> UcxTransport:
    """A started UCX transport on the network devices of `host` (`ucx_options_for`);
    `tls`, if given, is UCX_TLS for this transport only (e.g. "tcp,self")."""
    ucx = ucx_options_for(host)
    if tls:
        ucx["TLS"] = tls
    transport = UcxTransport(ucx_options=ucx)
    transport.start()
    return transport


def open_server(host: str, port: int, secret: str | None) -> tuple[AioServer, str]:
    """A gRPC server bound to `host:port` (port 0: any free one), not started, requiring
    `secret` on every call when given; and the address peers reach it at."""
    server = AioServer(f"{host}:{port}", secret)
    return server, f"{host}:{server.port}"


def add_kv_control(
    server: AioServer,
    engine_id: EngineId,
    layout: KVLayout,
    transport: UcxTransport,
    prefill: PrefillConnector | None,
) -> None:
    """Mount KVControl on `server` (before it starts): the handshake (layout, UCX address)
    for everyone, pulls and releases of kept KV where `prefill` is given."""
    control = KVControlServicer(engine_id, layout, transport.address, prefill)
    server.add(lambda s: kv_control_pb2_grpc.add_KVControlServicer_to_server(control, s))
