"""A job whose reader has gone (the client left, the proxy closed it) ends what it started:
a cancelled call is no lost worker, so nothing is retried or migrated after close()."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.proxy.config import ProxyConfig
from hybrid_pd.proxy.dispatch import Dispatcher
from hybrid_pd.proxy.metrics import ProxyMetrics
from hybrid_pd.proxy.routing import WorkerPool
from tests.proxy.conftest import assert_no_leaks


def test_a_closed_job_neither_migrates_nor_starts_a_leg(workers):
    pool = WorkerPool([], [w.address for w in workers], stats_interval_ms=0)
    metrics = ProxyMetrics()
    d = Dispatcher(ProxyConfig(), pool, metrics)
    params = SamplingParams(max_tokens=300, ignore_eos=True)

    async def run():
        job = d.start("closed-1", [5, 6, 7, 8], params, time.monotonic())
        events = job.events()
        first = await anext(events)
        job.close()  # what the proxy does when the client leaves
        # The cancelled call's CANCELLED reaches the stream's queue behind any chunks it
        # held: a reader that goes on (Python 3.11's wait_for can swallow the task's own
        # cancellation) must end there, not migrate the request to the other worker.
        await asyncio.sleep(0.3)
        more = []
        with pytest.raises(asyncio.CancelledError):
            async for ev in events:
                more += ev.token_ids
        return job, first, more

    try:
        job, first, more = asyncio.run(run())
        assert first.token_ids and len(first.token_ids) + len(more) < 300
        assert job.migrations == 0 and len(job.legs) == 1 and job.legs[0].aborted
        migrated = metrics.registry.get_sample_value(
            "hybrid_pd_proxy_failures_total", {"kind": "migrated"}
        )
        assert not migrated
        # A closed job starts no leg: one added now is aborted at once.
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(anext(job._decode(None)))
        assert len(job.legs) == 1
        assert_no_leaks(workers)
    finally:
        pool.close()
