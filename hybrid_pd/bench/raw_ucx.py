"""Raw ucxx bandwidth: the reference figure next to which `bench transfer` and the UCX bench
(`python -m hybrid_pd.bench.ucx`) put the connector's own. A buffer moves as plain ucxx tag
messages on a `UcxTransport`'s worker and endpoints, with none of the transport's batching,
IOV packing or bookkeeping; for that it reaches into the transport's event loop on purpose."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from hybrid_pd.connector.ucx import TransferError, UcxTransport, wire_tags
from hybrid_pd.connector.ucx.iov import as_buffer
from hybrid_pd.connector.ucx.ops import consume as _consume


def _as_buffer(t: torch.Tensor) -> Any:
    """`iov.as_buffer(t)`, a CUDA tensor's stream synchronized first: the data must be in
    memory before UCX reads or writes it."""
    buf = as_buffer(t)
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    return buf


def raw_bandwidth(
    transport: UcxTransport,
    peer: bytes,
    tag: int,
    buffer: torch.Tensor,
    *,
    repeats: int,
    send: bool,
    timeout: float = 60.0,
) -> list[float]:
    """Move `buffer` `repeats` times as one plain ucxx tag message each (no bookkeeping of
    the transport); the sender (`send=True`) and the receiver (`send=False`) call it at the
    same time with the same tag. Returns seconds per message measured in the loop thread (from
    submission to completion; on the receiver, the first includes waiting for the sender).
    Message j uses the wire tag of `tag + j`."""
    transport._check_open()
    sender = transport.address if send else bytes(peer)
    tags = wire_tags(sender, tag, repeats)
    buf = _as_buffer(buffer)

    async def run() -> list[float]:
        ucx = transport._ucx
        times = []
        ep = transport._endpoint(bytes(peer)) if send else None
        for t in tags:
            t0 = time.perf_counter()
            if send:
                req = ep.tag_send(ucx.Array(buf), ucx.Tag(t))
            else:
                req = transport._worker.tag_recv(ucx.Array(buf), ucx.Tag(t), ucx.TagMaskFull)
            w = asyncio.ensure_future(req.wait())
            try:
                await asyncio.wait_for(asyncio.shield(w), timeout)
            except TimeoutError:
                transport._ucx.cancel(req)
                w.add_done_callback(_consume)
                raise TransferError("raw transfer timed out") from None
            times.append(time.perf_counter() - t0)
        return times

    return transport._call(run(), timeout * repeats)
