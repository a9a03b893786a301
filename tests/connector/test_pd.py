"""Prefill and decode in two processes (real gRPC, real UCX): output equals one engine."""

from __future__ import annotations

import grpc
import pytest

from hybrid_pd.api.wire import sampling_to_pb
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.kvcache.grouping import HMAOffError, plan_groups
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import FullAttentionSpec
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
from tests.checkpoints import BUILDERS, MAMBA_CHUNK, SW_WINDOW
from tests.connector.pd_fixtures import (
    Pair,
    no_leaks,
    prompt,
    reference_engine,
    reference_tokens,
    wait_until,
)

pytestmark = pytest.mark.slow

N_NEW = 12
# Shorter and longer than the sliding window (16); several Mamba2 (16) and GDN (64) chunks;
# past the 64 positions llama3 RoPE keeps unscaled in the llama checkpoint.
LENGTHS = (5, 3 * SW_WINDOW + 1, 9 * MAMBA_CHUNK + 3)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def arch(request, checkpoint):
    path = checkpoint(request.param)
    pair = Pair(path, one_sided=True)  # both pull paths: two-sided in the test below
    try:
        yield request.param, path, pair, reference_engine(path)
    finally:
        pair.close()


def test_pd_output_equals_single_engine(arch):
    name, path, pair, ref = arch
    sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    kv_config = ref.kv_config
    spec = cache_spec_from_config(str(path), dtype="float32")
    windowed = any(not isinstance(s, FullAttentionSpec) for s in spec.layers.values())
    for i, n in enumerate(LENGTHS):
        p = prompt(n, seed=i)
        expected = reference_tokens(ref, p, N_NEW)
        assert len(set(expected)) >= 4, "reference output does not vary"
        reads = pair.prefill.stats()["prefill_connector"]["read_pulls"]
        first = pair.prefill.prefill(f"{name}-{i}", p, sampling)
        assert first.first_token == expected[0]
        out = pair.decode.generate(f"{name}-{i}", p, sampling, first.kv_transfer_params)
        assert out.error == "" and out.token_ids == expected, name
        # Bytes shipped are the computed minimum: every group's needed pages, nothing more.
        assert out.transfer["bytes"] == kv_config.bytes_per_request(n)
        assert not out.transfer["recomputed"]
        # Decode read the blocks itself (one-sided, as this pair asks), one read per run of
        # blocks, and the prefill worker confirmed that read.
        assert pair.prefill.stats()["prefill_connector"]["read_pulls"] == reads + 1
        assert 1 <= out.transfer["messages"] <= len(kv_config.groups) * (n + 1)
        try:
            off = plan_groups(spec, hma=False, block_size=kv_config.block_size)
            if not windowed:  # full attention only: nothing for HMA to save
                assert off.bytes_per_request(n) == out.transfer["bytes"]
            elif n > 2 * SW_WINDOW:  # past the window HMA ships strictly less
                assert off.bytes_per_request(n) > out.transfer["bytes"]
        except HMAOffError:
            assert spec.state_layers  # Mamba/GDN models cannot run with HMA off at all
    for client in (pair.prefill, pair.decode):
        wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")


@pytest.mark.parametrize("packed", [True, False])
def test_two_sided_pulls_and_the_scatter_gather_flag(checkpoint, packed):
    """A pair with one-sided reads off (HYBRID_PD_UCX_ONESIDED=0) pulls two-sided, prefill
    sends: however
    the blocks lie in the two pools, one scatter-gather message carries them; with
    `--no-kv-scatter-gather` one UCX message per run of blocks. The output is the same."""
    path = checkpoint("gemma3")
    ref = reference_engine(path)
    decode_args = [] if packed else ["--no-kv-scatter-gather"]
    pair = Pair(path, decode_args=decode_args, one_sided=False)
    try:
        sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
        messages = []
        for i, n in enumerate((9 * MAMBA_CHUNK + 3, 100)):
            p = prompt(n, seed=i)
            first = pair.prefill.prefill(f"off-{i}", p, sampling)
            out = pair.decode.generate(f"off-{i}", p, sampling, first.kv_transfer_params)
            assert out.error == "" and out.token_ids == reference_tokens(ref, p, N_NEW)
            assert out.transfer["bytes"] == ref.kv_config.bytes_per_request(n)
            messages.append(out.transfer["messages"])
        assert pair.prefill.stats()["prefill_connector"]["read_pulls"] == 0
        if packed:
            assert messages == [1, 1]
        else:
            assert max(messages) > 1, messages
    finally:
        pair.close()


# One family per kind of cache group mix (the engine-level test covers every family).
FOLLOW_UP_FAMILIES = {"gemma3", "mistral", "qwen3_5", "granite_hybrid", "falcon_h1"}


def test_follow_up_turn_pulls_only_what_decode_lacks(arch):
    """A conversation's second turn (turn 1's prompt and answer, then a new message): decode
    takes the blocks its prefix cache holds and pulls exactly the rest (state pages always
    come); output equals one engine's; the decode worker counts what it did not pull."""
    name, _, pair, ref = arch
    if name not in FOLLOW_UP_FAMILIES:
        pytest.skip("covered by tests/engine/test_remote_kv.py")
    sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    kv_config = ref.kv_config
    bs, page = kv_config.block_size, kv_config.page_size_bytes
    turn1 = prompt(9 * MAMBA_CHUNK + 3, seed=31)
    first = pair.prefill.prefill(f"{name}-turn1", turn1, sampling)
    out1 = pair.decode.generate(f"{name}-turn1", turn1, sampling, first.kv_transfer_params)
    assert out1.error == "" and out1.transfer["held_tokens"] == 0
    turn2 = turn1 + out1.token_ids + prompt(3 * SW_WINDOW + 1, seed=32)
    expected = reference_tokens(ref, turn2, N_NEW)
    held_before = pair.decode.stats()["decode_connector"]["held_blocks"]
    first = pair.prefill.prefill(f"{name}-turn2", turn2, sampling)
    out = pair.decode.generate(f"{name}-turn2", turn2, sampling, first.kv_transfer_params)
    assert out.error == "" and out.token_ids == expected and not out.transfer["recomputed"]
    # Decode computed turn 1's prompt and all its answer tokens but the last: whole blocks
    # of those it holds, in every attention group from the first block the group keeps.
    computed = (len(turn1) + N_NEW - 1) // bs

    def first_block(group, n: int) -> int:
        return group.spec.first_needed_token(n) // bs

    held = [
        0 if g.spec.kind == "state" else max(0, computed - first_block(g, len(turn2)))
        for g in kv_config.groups
    ]
    if any(g.spec.kind == "full" for g in kv_config.groups):  # (Mistral's all slide)
        assert sum(held) > 0, "the checkpoint's block size leaves nothing to reuse"
    assert out.transfer["bytes"] == kv_config.bytes_per_request(len(turn2)) - sum(held) * page
    full = [n for g, n in zip(kv_config.groups, held, strict=True) if g.spec.kind == "full"]
    assert out.transfer["held_tokens"] == (min(full) * bs if full else 0)
    stats = pair.decode.stats()["decode_connector"]
    assert stats["held_blocks"] - held_before == sum(held)
    for client in (pair.prefill, pair.decode):
        wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")


def test_stats_reply_is_typed(arch):
    """Stats cross the wire as typed fields; each role's section is there on its role only,
    and the counters saw the transfer."""
    name, _, pair, _ = arch
    sampling = sampling_to_pb(SamplingParams(max_tokens=2, ignore_eos=True))
    p = prompt(2 * SW_WINDOW + 3, seed=99)
    first = pair.prefill.prefill(f"{name}-stats", p, sampling)
    out = pair.decode.generate(f"{name}-stats", p, sampling, first.kv_transfer_params)
    assert out.error == "" and not out.transfer["recomputed"]
    moved = out.transfer["bytes"]
    for client in (pair.prefill, pair.decode):
        wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")
    replies = {}
    for role, proc in zip(("prefill", "decode"), pair.procs, strict=True):
        with grpc.insecure_channel(proc.address) as channel:
            r = pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=30)
        assert (r.role, r.address) == (role, proc.address) and r.engine_id.startswith(role)
        assert r.model and r.page_size_bytes > 0 and r.block_size > 0
        assert r.num_blocks > 1 and r.free_blocks == r.num_blocks - 1
        assert (r.kv_requests, r.running, r.waiting, r.receiving) == (0, 0, 0, 0)
        assert r.integrity == "ok" and r.published_at > 0
        assert r.cpu_kernels == "on"  # CPU workers on a machine with a C compiler
        assert r.HasField("prefill") == (role == "prefill")
        assert r.HasField("decode") == (role == "decode")
        replies[role] = r
    pre, dec = replies["prefill"], replies["decode"]
    assert pre.prefill.leases == 0
    assert pre.prefill.connector.handed_over >= 1 and pre.prefill.connector.pulled >= 1
    # the pulls were read one-sided (this pair asks for it): the prefill worker counts what it
    # confirmed and sent nothing; decode's transport counts the bytes it read
    assert pre.prefill.connector.bytes_sent >= moved and pre.transport.bytes_sent == 0
    assert pre.prefill.connector.read_pulls == pre.prefill.connector.pulled
    assert pair.procs[0].address in dec.decode.peers
    c = dec.decode.connector
    assert c.pulls >= 1 and c.bytes >= moved and c.seconds > 0 and c.last_error == ""
    assert dec.transport.bytes_read == c.bytes and pre.transport.endpoints >= 1
    assert dec.transport.messages_read >= c.pulls and dec.transport.bytes_received == 0
    # The client's dict view keeps the role sections apart too.
    assert {"leases", "prefill_connector"} <= set(pair.prefill.stats())
    assert not {"peers", "decode_connector"} & set(pair.prefill.stats())
    assert {"peers", "decode_connector"} <= set(pair.decode.stats())
    assert not {"leases", "prefill_connector"} & set(pair.decode.stats())
