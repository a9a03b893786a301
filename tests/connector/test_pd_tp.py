"""P/D between tensor-parallel workers (real rank processes, real gloo groups, real gRPC
and UCX): for every pair of TP sizes the output equals one TP-1 engine's, each decode rank
receives exactly its share of the KV (`connector.tp_plan`), and no block is left behind
on any side."""

from __future__ import annotations

import math
import secrets

import pytest

from hybrid_pd.api.wire import sampling_to_pb
from hybrid_pd.connector.tp_plan import ShardedPlan
from hybrid_pd.engine.sampling import SamplingParams
from tests.checkpoints import MAMBA_CHUNK
from tests.connector.pd_fixtures import (
    Pair,
    no_leaks,
    prompt,
    reference_engine,
    reference_tokens,
    staged_run,
    tp_layout,
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


@pytest.mark.parametrize(("name", "p_tp", "d_tp"), PAIRS)
def test_pd_between_tp_sizes_equals_single_engine(name, p_tp, d_tp, checkpoint):
    path = checkpoint(name)
    ref = reference_engine(path)
    src, dst = tp_layout(path, ref.kv_config, p_tp), tp_layout(path, ref.kv_config, d_tp)
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


# Overlap (the staged hand-over) between TP groups: Mamba2 + attention (n_groups 2: B / C
# split at 2 ranks, replicated at 4) and GDN + attention, read one-sided or sent two-sided
# (checkpoint, prefill TP, decode TP, one-sided).
STAGED_PAIRS = [
    ("granite_hybrid", 1, 2, True),
    pytest.param("granite_hybrid", 2, 1, False, marks=pytest.mark.slow),
    pytest.param("qwen3_5", 2, 2, True, marks=pytest.mark.slow),
    pytest.param("granite_hybrid", 2, 4, False, marks=pytest.mark.slow),
]
CHUNK = 32  # the prefill worker's step: the prompt takes several
SLOW = {"HYBRID_PD_INJECT_FAULT": "slow_prefill:0.15"}  # each step of a staged prefill


@pytest.mark.parametrize(("name", "p_tp", "d_tp", "one_sided"), STAGED_PAIRS)
def test_staged_hand_over_between_tp_sizes(name, p_tp, d_tp, one_sided, checkpoint):
    """Decode follows a prefill of several steps and pulls each attention block once it is
    final, each decode rank its own heads from the prefill ranks holding them; the final
    pull moves the rest (state pages, the last blocks). Tokens equal one TP-1 engine's;
    staged and final pulls together move exactly the minimum, rank by rank. The second
    prompt shares the first's two leading blocks, which decode's prefix cache holds: staging
    starts after them and nothing held is pulled."""
    path = checkpoint(name)
    ref = reference_engine(path)
    bs = ref.kv_config.block_size
    src, dst = tp_layout(path, ref.kv_config, p_tp), tp_layout(path, ref.kv_config, d_tp)
    plan = ShardedPlan(src, dst, lambda: [])
    attention = [g.kind != "state" for g in src.groups]
    pair = Pair(
        path,
        prefill_args=("--tensor-parallel-size", str(p_tp), "--max-num-batched-tokens", str(CHUNK)),
        decode_args=("--tensor-parallel-size", str(d_tp)),
        env=SLOW,
        one_sided=one_sided,
    )
    try:
        sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
        first_prompt = prompt(9 * MAMBA_CHUNK + 3, seed=5)
        shared = first_prompt[: 2 * bs] + prompt(len(first_prompt) - 2 * bs, seed=6)
        by_rank, staged_total = [0] * d_tp, 0
        for i, p in enumerate((first_prompt, shared)):
            expected = reference_tokens(ref, p, N_NEW)
            assert len(set(expected)) >= 4, "reference output does not vary"
            rid = f"{name}-{i}"
            first, out = staged_run(pair, rid, p, sampling, secrets.token_urlsafe(16))
            assert first.first_token == expected[0]
            assert out.error == "" and out.token_ids == expected, (name, p_tp, d_tp, i)
            assert not out.transfer["recomputed"]
            held = out.transfer["held_tokens"] // bs
            assert held == (0 if i == 0 else 2), out.transfer
            # the minimum: every kept block but those decode's prefix cache held
            kept = [
                list(g[held:] if a else g)
                for g, a in zip(first.kv_transfer_params.block_ids, attention, strict=True)
            ]
            minimum = plan.bytes_by_rank(plan.runs(kept, kept), "dst")
            by_rank = [a + b for a, b in zip(by_rank, minimum, strict=True)]
            assert out.transfer["bytes"] == sum(minimum)
            staged = out.transfer["staged_bytes"]
            staged_total += staged
            assert 0 < staged < out.transfer["bytes"]
            # staged: whole attention blocks (rows of every decode rank); states at the end
            per_block, state = [], 0
            for g, ids in enumerate(kept):
                only = [ids if h == g else [] for h in range(len(kept))]
                nbytes = plan.nbytes(plan.runs(only, only))
                if not attention[g]:
                    state += nbytes
                elif ids:
                    per_block.append(nbytes // len(ids))
            assert state > 0 and out.transfer["bytes"] - staged >= state
            assert staged % math.gcd(*per_block) == 0
        stats = pair.decode.stats()["decode_connector"]
        assert stats["bytes_by_rank"] == by_rank and stats["bytes"] == sum(by_rank)
        assert stats["staged_pulls"] >= 2 and stats["staged_void"] == 0
        assert stats["staged_bytes"] == staged_total
        pre = pair.prefill.stats()["prefill_connector"]
        assert pre["staged_pulls"] == stats["staged_pulls"]
        assert pre["staged_bytes"] == staged_total
        if one_sided:  # every pull, staged and final, read and confirmed
            assert pre["read_pulls"] == pre["pulled"] + pre["staged_pulls"]
        else:  # every pull sent by the prefill worker
            assert pre["read_pulls"] == 0 and pre["messages_sent"] >= pre["staged_pulls"] + 2
        for client in (pair.prefill, pair.decode):
            wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")
    finally:
        pair.close()
