"""A worker's admission bound (`--max-queued`) holds under a burst: requests arriving
together while the engine is busy must not all slip past the check before any of them is
counted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from hybrid_pd.launcher.local import start_worker
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
from tests.proxy.conftest import KV_MEMORY

pytestmark = pytest.mark.timeout(120)


async def _burst(address: str, n: int, max_tokens: int) -> list[str]:
    """`n` Generate calls sent at once; per call "ok" or the status code's name."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        await channel.channel_ready()

        async def one(i: int) -> str:
            req = pb.GenerateRequest(
                prompt_ids=[(11 * i + 5 * j + 3) % 250 for j in range(12)],
                sampling=pb.Sampling(max_tokens=max_tokens, top_p=1.0, ignore_eos=True),
            )
            try:
                async for _ in stub.Generate(req, timeout=60):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return "ok"

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_burst_on_a_busy_worker_respects_max_queued(tiny_path, cache_dir):
    """One sequence at a time, one more may wait: while a long request runs, a burst of 8
    gets at most one admission (it waits in the scheduler) and the rest fail fast with
    RESOURCE_EXHAUSTED. Before the fix the slot was counted only once the engine thread had
    taken the request (after its current step), so the whole burst was admitted."""
    args = ["--model", str(tiny_path), "--kv-memory", KV_MEMORY, "--threads", "1"]
    proc = start_worker(
        "decode",
        *args,
        "--max-queued",
        "1",
        "--max-num-seqs",
        "1",
        env={"HYBRID_PD_CACHE": str(cache_dir)},
        timeout=60,
    )
    try:

        async def scenario():
            # A long request occupies the one sequence slot (it leaves the queue at its
            # first token); then the burst arrives while every engine step is busy.
            long = asyncio.create_task(_burst(proc.address, 1, 400))
            await asyncio.sleep(0.5)
            burst = await _burst(proc.address, 8, 4)
            return await long, burst

        long, burst = asyncio.run(scenario())
        assert long == ["ok"]
        assert set(burst) <= {"ok", "RESOURCE_EXHAUSTED"}, burst
        assert burst.count("ok") <= 1, burst
    finally:
        proc.stop()
