"""A worker's admission bound (`--max-queued`) holds under a burst: requests arriving
together while the engine is busy must not all slip past the check before any of them is
counted."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from hybrid_pd.launcher.local import start_worker
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
from tests.proxy.conftest import KV_MEMORY, assert_no_leaks

pytestmark = pytest.mark.timeout(120)


async def _generate(stub, i: int, max_tokens: int) -> str:
    """One Generate call: "ok", or the name of the status code it failed with."""
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


def test_burst_on_a_busy_worker_respects_max_queued(tiny_path, cache_dir):
    """One sequence at a time, one more may wait: while a long request runs, a burst of 8
    gets one admission (it waits in the scheduler) and 7 fail fast with RESOURCE_EXHAUSTED.
    Before the fix the slot was counted only once the engine thread had taken the request
    (after its current step), so several of the burst were admitted."""
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

    async def scenario():
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            await channel.channel_ready()
            # A long request takes the one sequence slot (and leaves the queue at its first
            # token); the burst then arrives while every engine step is busy.
            long = asyncio.create_task(_generate(stub, 0, 2000))
            await asyncio.sleep(0.5)
            burst = [asyncio.create_task(_generate(stub, i, 4)) for i in range(1, 9)]
            deadline = time.monotonic() + 10
            while sum(t.done() for t in burst) < 7 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # time for a wrongly admitted one to show
            answered = [t.result() for t in burst if t.done()]
            busy = not long.done()
            for t in [long, *burst]:  # the client leaves: the worker drops them
                t.cancel()
            await asyncio.gather(long, *burst, return_exceptions=True)
            return busy, answered

    try:
        busy, answered = asyncio.run(scenario())
        assert busy, "the long request ended before the burst: nothing was tested"
        assert answered == ["RESOURCE_EXHAUSTED"] * 7, answered
        assert_no_leaks([proc])
    finally:
        proc.stop()
