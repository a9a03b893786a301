"""Raw bandwidth of plain ucxx tag messages between two transports (a benchmark helper)."""

from __future__ import annotations

import asyncio
import time

import torch

from hybrid_pd.connector.ucx.errors import TransferError
from hybrid_pd.connector.ucx.iov import prepare
from hybrid_pd.connector.ucx.ops import consume
from hybrid_pd.connector.ucx.tags import wire_tags
from hybrid_pd.connector.ucx.transport import UcxTransport


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
    """Move `buffer` `repeats` times as one plain ucxx tag message each (none of the
    transport's bookkeeping); the sender (`send=True`) and the receiver (`send=False`) call
    it at the same time with the same tag. Returns seconds per message measured in the loop
    thread (from submission to completion; on the receiver, the first includes waiting for
    the sender). Message j uses the wire tag of `tag + j`."""
    transport._check_open()
    sender = transport.address if send else bytes(peer)
    tags = wire_tags(sender, tag, repeats)
    (buf,), _ = prepare([buffer])

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
                w.add_done_callback(consume)
                raise TransferError("raw transfer timed out") from None
            times.append(time.perf_counter() - t0)
        return times

    return transport._call(run(), timeout * repeats)
