"""`hybrid-pd bench transfer` on a small real layout: two processes, real UCX and gRPC."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hybrid_pd.bench import transfer as transfer_bench

if importlib.util.find_spec("ucxx") is None:
    pytest.skip("ucxx not installed", allow_module_level=True)


def test_churned_pool_moves_in_one_message_per_request_and_intact():
    """After churn the request's blocks lie scattered in both pools. Read one-sided (the
    default), one read per run; sent (`--two-sided`), one UCX message per run costs
    hundreds of messages, scatter-gather one. Either way the bytes are the minimum, every
    page lands where it belongs, nothing leaks."""
    runs = {}
    for one_sided, sg in ((True, True), (False, True), (False, False)):
        r = transfer_bench.bench_transfer(
            "gemma-3-1b-it",
            (512, 2048),
            repeats=2,
            churn=100,
            seed=3,
            scatter_gather=sg,
            one_sided=one_sided,
        )
        assert r["scatter_gather"] is sg and r["one_sided"] is one_sided and r["intact"]
        # one host: a one-sided pull is this process's own process_vm_readv
        assert r["pull_kind"] == ("read" if one_sided else "sent")
        assert r["leaked_blocks"] == {"prefill": 0, "decode": 0}
        assert all(row["bytes"] == row["bytes_min"] for row in r["runs"])
        runs[one_sided, sg] = r["runs"]
    assert [row["messages_per_request"] for row in runs[False, True]] == [1, 1]
    assert all(row["messages_per_request"] > 100 for row in runs[False, False])
    # one read per run of blocks: as many as the unpacked messages
    reads = [row["messages_per_request"] for row in runs[True, True]]
    assert reads == [row["messages_per_request"] for row in runs[False, False]]


def test_intact_sees_a_page_that_did_not_arrive():
    pool = torch.zeros(8, 64, dtype=torch.uint8)
    transfer_bench._stamp(pool, [1, 2, 5])
    pool[[6, 7]] = pool[[1, 2]]  # "pulled" 1 -> 6, 2 -> 7
    assert transfer_bench._intact(pool, ((1,), (2,)), ([6], [0, 7]))  # null ids skipped
    assert not transfer_bench._intact(pool, ((1,), (5,)), ([6], [7]))
