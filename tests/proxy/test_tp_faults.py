"""A tensor-parallel rank dies mid-request: its worker stops (exit 70), the proxy moves the
streams to another decode worker, every answer stays exact, and no block is left on any
surviving worker (a tensor-parallel prefill worker included).

Every worker here has two ranks and the reference is an engine of two ranks: a migrated
stream is recomputed (prompt + tokens so far) by a prefill worker, and at TP 2 that equals
decoding step by step bit for bit, as at TP 1. Between TP sizes it does not (their
row-parallel sums add in another order), which can move a near-tie hundreds of tokens
later (docs/architecture.md, "Tensor parallelism")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.engine.test_tp import tp_tokens
from tests.proxy.conftest import assert_no_leaks, make_proxy
from tests.proxy.test_failures import metric
from tests.proxy.test_resilience import Fleet, body_for, prompt, stream_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.fixture
def fleet(tiny_path, cache_dir):
    f = Fleet(tiny_path, cache_dir)
    yield f
    f.close()


def test_decode_rank_killed_mid_stream_migrates(fleet, tiny_path):
    tp2 = ("--tensor-parallel-size", "2")
    pre, dec_tp, dec_b = fleet.add_all(("prefill", *tp2), ("decode", *tp2), ("decode", *tp2))
    proxy = make_proxy(
        tiny_path,
        prefill_addresses=(pre.address,),
        decode_addresses=(dec_tp.address, dec_b.address),
    )
    n_new = 300
    prompts = [prompt(300 + i, 48) for i in range(4)]
    want = tp_tokens(tiny_path, 2, [prompts], n_new, max_batched_tokens=2048)["tokens"][0]
    ranks = [c for c in _children(dec_tp.proc.pid) if "tp_ranks" in _cmdline(c)]
    assert len(ranks) == 1, "the TP-2 decode worker should have one follower rank"

    async def run():
        async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as c:
            tasks = [asyncio.create_task(stream_tokens(c, body_for(p, n_new))) for p in prompts]
            # until the TP worker streams (at most 60 s: a loaded machine prefills slowly),
            # then kill its rank 1
            for _ in range(1200):
                await asyncio.sleep(0.05)
                snap = {w["address"]: w for w in proxy.pool.snapshot()}
                if snap[dec_tp.address]["outstanding_decodes"] > 0:
                    break
                if all(t.done() for t in tasks):
                    break
            else:
                raise AssertionError(f"no stream reached the tensor-parallel decode worker: {snap}")
            if snap[dec_tp.address]["outstanding_decodes"] == 0:
                ended = [t.exception() or "finished" for t in tasks]
                raise AssertionError(f"the streams ended before reaching the TP worker: {ended}")
            await asyncio.sleep(0.3)
            import os
            import signal

            os.kill(ranks[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
        assert [e for _, e in results if e] == []
        got = [ids for ids, _ in results]
        first_diff = [
            next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
            for g, w in zip(got, want, strict=True)
        ]
        assert got == want, f"first differing positions: {first_diff}"
        text = httpx.get(proxy.url + "/metrics").text
        assert metric(text, 'hybrid_pd_proxy_failures_total{kind="migrated"}') >= 1
    finally:
        proxy.stop()
    assert dec_tp.proc.wait(timeout=30) == 70  # the worker went down with its rank
    assert_no_leaks([pre, dec_b])
