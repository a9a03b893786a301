"""P/D between tensor-parallel workers (real rank processes, real gloo groups, real gRPC
and UCX): for every pair of TP sizes the output equals one TP-1 engine's, each decode rank
receives exactly its share of the KV (`connector.tp_plan`), and no block is left behind
on any side."""

from __future__ import annotations

import pytest

from hybrid_pd.api.wire import sampling_to_pb
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.tp_plan import ShardedPlan
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.engine.tp.plans import plan_for
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config, load_config
from hybrid_pd.kvcache.tp_layout import rank_kv_config
from tests.checkpoints import MAMBA_CHUNK
from tests.connector.pd_fixtures import (
    Pair,
    no_leaks,
    prompt,
    reference_engine,
    reference_tokens,
    wait_until,
)

N_NEW = 10
LENGTHS = (5, 5 * MAMBA_CHUNK + 3)
# (checkpoint, prefill TP, decode TP); the first runs in every suite, the rest are slow
PAIRS = [
    ("granite_hybrid", 1, 2),
    pytest.param("granite_hybrid", 2, 1, marks=pytest.mark.slow),
    pytest.param("granite_hybrid", 2, 2, marks=pytest.mark.slow),
    pytest.param("qwen3_5", 2, 1, marks=pytest.mark.slow),
    pytest.param("gemma3", 1, 2, marks=pytest.mark.slow),
    pytest.param("jamba", 2, 1, marks=pytest.mark.slow),
]


def _layout(path, kv_config, size: int) -> KVLayout:
    if size == 1:
        return KVLayout.of(kv_config, "m")
    rank_spec = cache_spec_from_config(plan_for(load_config(path), size).rank_config, "float32")
    return KVLayout.of(rank_kv_config(kv_config, rank_spec), "m", kv_config, size)


@pytest.mark.parametrize(("name", "p_tp", "d_tp"), PAIRS)
def test_pd_between_tp_sizes_equals_single_engine(name, p_tp, d_tp, checkpoint):
    path = checkpoint(name)
    ref = reference_engine(path)
    src, dst = _layout(path, ref.kv_config, p_tp), _layout(path, ref.kv_config, d_tp)
    pair = Pair(
        path,
        prefill_args=("--tensor-parallel-size", str(p_tp)),
        decode_args=("--tensor-parallel-size", str(d_tp)),
        one_sided=True,
    )
    try:
        sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
        expected_by_rank = [0] * d_tp
        for i, n in enumerate(LENGTHS):
            p = prompt(n, seed=i)
            expected = reference_tokens(ref, p, N_NEW)
            assert len(set(expected)) >= 4, "reference output does not vary"
            first = pair.prefill.prefill(f"tp-{i}", p, sampling)
            assert first.first_token == expected[0]
            kv = first.kv_transfer_params
            out = pair.decode.generate(f"tp-{i}", p, sampling, kv)
            assert out.error == "" and out.token_ids == expected, (name, p_tp, d_tp, n)
            assert not out.transfer["recomputed"]
            if p_tp != 1 or d_tp != 1:
                plan = ShardedPlan(src, dst, lambda: [])
                runs = plan.runs(kv.block_ids, kv.block_ids)
                for rank, b in enumerate(plan.bytes_by_rank(runs, "dst")):
                    expected_by_rank[rank] += b
        stats = pair.decode.stats()
        assert stats["tensor_parallel_size"] == d_tp
        assert stats["decode_connector"]["bytes_by_rank"] == expected_by_rank
        assert sum(expected_by_rank) == stats["decode_connector"]["bytes"]
        assert pair.prefill.stats()["tensor_parallel_size"] == p_tp
        # read one-sided from the prefill ranks' pools (rank 0 maps them all)
        assert pair.prefill.stats()["prefill_connector"]["read_pulls"] == len(LENGTHS)
        for client in (pair.prefill, pair.decode):
            wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")
    finally:
        pair.close()
