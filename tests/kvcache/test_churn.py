"""Contiguity after churn: requests get few runs of ids; the churn itself leaks nothing."""

from __future__ import annotations

import random

import pytest

from hybrid_pd.kvcache.block_pool import BlockPool
from hybrid_pd.kvcache.churn import churn
from hybrid_pd.kvcache.ids import RequestId
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.specs import FullAttentionSpec, SlidingWindowSpec, StateSpec
from tests.kvcache.kv_checks import tiny_config

FA = FullAttentionSpec(1, 4, "float32")
SW = SlidingWindowSpec(1, 4, "float32", window=32)
ST = StateSpec(((2, 3), (4,)), ("float32", "float32"), mamba_type="gdn")


def num_runs(ids: list[int]) -> int:
    ids = sorted(b for b in ids if b)
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


@pytest.mark.parametrize("seed", range(3))
def test_uncached_allocation_takes_one_run_when_one_holds_it(seed: int) -> None:
    rng = random.Random(seed)
    pool = BlockPool(2000, enable_caching=False)
    held = []
    for _ in range(1000):  # random sizes, freed in random order
        n = rng.randint(1, 40)
        if pool.can_allocate(n) and rng.random() < 0.55:
            held.append(pool.allocate(n))
        elif held:
            pool.free(held.pop(rng.randrange(len(held))))
    pool.check_integrity()
    longest = max(e - s for s, e in pool._free_run_ids())
    for n in (1, longest // 2, longest):
        got = pool.allocate(n)
        assert num_runs([b.block_id for b in got]) == 1
        pool.free(got)
    pool.check_integrity()


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("caching", [False, True])
def test_churned_manager_hands_out_few_runs_and_leaks_nothing(role: str, caching: bool) -> None:
    config = tiny_config(FA, SW, ST, block_size=4)
    kv = KVCacheManager(config, 1200, enable_caching=caching)
    report = churn(kv, 300, 512, role=role, chunk=64, keep_free=600, seed=1)
    kv.check_integrity()
    assert report.free_blocks_after >= 600 and kv.pool.num_free_blocks == report.free_blocks_after
    # A 512-token request in one go: with caching off every free block sits in a run, and
    # the longest runs are taken first, so each group's blocks come in a few runs.
    rid = RequestId("measured")
    ids = kv.allocate_external(rid, list(range(513)), 512)
    assert ids is not None
    kv.check_integrity()
    runs = [num_runs(g) for g in ids]
    if not caching:
        assert all(r <= 4 for r in runs), runs
    kv.free(rid)
    for i in range(300):  # free what the churn left alive: every block comes back
        kv.free(RequestId(f"churn-{i}"))
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1
    if not caching:
        assert kv.pool._free_run_ids() == [(1, kv.pool.num_blocks)]


def test_fresh_pool_gives_each_group_one_run() -> None:
    kv = KVCacheManager(tiny_config(FA, SW, ST, block_size=4), 400, enable_caching=False)
    ids = kv.allocate_external(RequestId("a"), list(range(257)), 256)
    assert ids is not None and [num_runs(g) for g in ids] == [1, 1, 1]
