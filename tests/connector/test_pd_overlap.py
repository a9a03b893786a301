"""Overlap: decode pulls a prompt's final attention blocks while its prefill still
runs (real worker processes, gRPC and UCX); the output equals one engine's."""

from __future__ import annotations

import secrets

import grpc
import pytest

from hybrid_pd.api.wire import sampling_to_pb
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

pytestmark = pytest.mark.slow

N_NEW = 8
CHUNK = 32  # the prefill worker's step: a long prompt takes several
SLOW = {"HYBRID_PD_INJECT_FAULT": "slow_prefill:0.15"}  # each step of a staged prefill


# Sliding windows + full attention, GDN + full attention, Mamba2 + full attention, and
# sliding windows alone (nothing to stage: the final pull moves it all).
@pytest.fixture(scope="module", params=["gemma3", "qwen3_5", "granite_hybrid", "mistral"])
def overlap_pair(request, checkpoint):
    path = checkpoint(request.param)
    pair = Pair(
        path, prefill_args=["--max-num-batched-tokens", str(CHUNK)], env=SLOW, one_sided=True
    )
    try:
        yield request.param, pair, reference_engine(path)
    finally:
        pair.close()


def test_staged_hand_over_equals_one_engine_and_ships_the_minimum(overlap_pair):
    name, pair, ref = overlap_pair
    sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    kv_config = ref.kv_config
    p = prompt(9 * MAMBA_CHUNK + 3, seed=5)  # five prefill steps
    expected = reference_tokens(ref, p, N_NEW)
    assert len(set(expected)) >= 4, "reference output does not vary"
    first, out = staged_run(pair, name, p, sampling, secrets.token_urlsafe(16))
    assert first.first_token == expected[0]
    assert first.kv_transfer_params.transfer_token  # the proxy's token names the kept KV
    assert out.error == "" and out.token_ids == expected, name
    assert not out.transfer["recomputed"]
    # Staged and final pulls together ship exactly the minimum; the staged part is whole
    # attention blocks that were final before the prefill ended.
    assert out.transfer["bytes"] == kv_config.bytes_per_request(len(p))
    staged = out.transfer["staged_bytes"]
    page = kv_config.page_size_bytes
    stats = pair.decode.stats()["decode_connector"]
    assert stats["staged_loads"] >= 1 and stats["staged_void"] == 0
    assert staged % page == 0 and staged < out.transfer["bytes"]
    if any(g.spec.kind == "full" for g in kv_config.groups):  # (Mistral's all slide)
        assert staged > 0 and stats["staged_pulls"] >= 1
    assert pair.prefill.stats()["prefill_connector"]["staged_bytes"] >= staged
    # every pull, staged and final, was read one-sided and confirmed by the prefill worker
    pre = pair.prefill.stats()["prefill_connector"]
    assert pre["read_pulls"] == pre["pulled"] + pre["staged_pulls"] >= 1
    for client in (pair.prefill, pair.decode):
        wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")


def test_a_first_token_that_ends_the_request_fails_the_staged_leg_and_frees_all(overlap_pair):
    """The prefill's first token is a stop token: nothing is kept, the staged decode leg
    ends with an error (it never learned a first token, so it does not recompute one) and
    no block stays allocated on either worker."""
    name, pair, ref = overlap_pair
    p = prompt(5 * MAMBA_CHUNK, seed=6)
    stop = reference_tokens(ref, p, 1)[0]
    sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, stop_token_ids=[stop]))
    with pytest.raises(grpc.RpcError) as failed:
        staged_run(pair, f"{name}-stop", p, sampling, secrets.token_urlsafe(16))
    assert failed.value.code() == grpc.StatusCode.ABORTED
    assert "prefill ended without keeping the KV" in failed.value.details()
    first = pair.prefill.prefill(f"{name}-stop2", p, sampling)  # what the prefill said
    assert first.finished and first.first_token == stop
    for client in (pair.prefill, pair.decode):
        wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")


@pytest.mark.parametrize("p_tp", [1, 2])
def test_a_prefill_preempted_while_staged_restages_and_stays_exact(p_tp, checkpoint):
    """A lease nobody pulls pins most of the prefill worker's pool: the staged request is
    preempted (its blocks freed, its epoch moved on) until the lease expires, then computed
    again. The decode worker drops what it staged from the freed blocks and pulls them
    again; the output equals one engine's and both workers end with every block free.
    `p_tp`: the prefill worker's ranks (2: each block's KV heads lie in two ranks' pools,
    both reused after the preemption; decode, one rank, pulls each block's two halves)."""
    path = checkpoint("llama")
    ref = reference_engine(path)
    kv, bs = ref.kv_config, ref.kv_config.block_size
    # 40 usable blocks (--kv-memory is each rank's pool: a rank's share of every page)
    pool = tp_layout(path, kv, p_tp).page_size_bytes * 41
    pair = Pair(
        path,
        prefill_args=["--kv-memory", str(pool), "--lease-s", "2", "--max-num-batched-tokens",
                      str(2 * bs), "--tensor-parallel-size", str(p_tp)],
        env={"HYBRID_PD_INJECT_FAULT": "slow_prefill:0.05"},
    )  # fmt: skip
    try:
        sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
        pinned = prompt(26 * bs, seed=40)
        pair.prefill.prefill("pinned", pinned, sampling)  # kept, never pulled: 26 blocks
        p = prompt(24 * bs, seed=41)
        expected = reference_tokens(ref, p, N_NEW)
        first, out = staged_run(pair, "preempted", p, sampling, secrets.token_urlsafe(16))
        assert first.first_token == expected[0]
        assert out.error == "" and out.token_ids == expected
        # Blocks staged from the freed pages moved twice: counted, whole pages.
        extra = out.transfer["bytes"] - kv.bytes_per_request(len(p))
        assert extra > 0 and extra % kv.page_size_bytes == 0
        assert pair.decode.stats()["decode_connector"]["staged_void"] >= 1
        assert pair.prefill.stats()["prefill_connector"]["expired"] == 1
        for client in (pair.prefill, pair.decode):
            wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")
    finally:
        pair.close()
