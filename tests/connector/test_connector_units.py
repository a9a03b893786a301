"""Connector pieces without processes: run planning, params parsing, layouts, leases."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.connector.base import SupportsHMA, TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.prefill import PrefillConnector
from hybrid_pd.connector.segments import (
    PagedPlan,
    PoolRegions,
    Segment,
    group_regions,
    pack_messages,
    plan_segments,
    split_iov,
)
from hybrid_pd.kvcache.grouping import plan_groups
from hybrid_pd.kvcache.specs import (
    FullAttentionSpec,
    ModelCacheSpec,
    SlidingWindowSpec,
    gdn_state_spec,
)
from hybrid_pd.proto import worker_pb2 as pb


def model(window: int = 32) -> ModelCacheSpec:
    layers = {
        "a0": FullAttentionSpec(2, 8, "float32"),
        "a1": FullAttentionSpec(2, 8, "float32"),
        "w0": SlidingWindowSpec(2, 8, "float32", window=window),
        "s0": gdn_state_spec(
            num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_kernel=4
        ),
    }
    return ModelCacheSpec("Toy", layers)


def test_segments_merge_runs_across_groups():
    segs = plan_segments([[5, 6, 7], [8], [20, 21]], [[1, 2, 3], [4], [9, 11]])
    assert segs == [Segment(5, 1, 4), Segment(20, 9, 1), Segment(21, 11, 1)]
    with pytest.raises(ValueError, match="group 1"):
        plan_segments([[1], [2, 3]], [[1], [2]])
    with pytest.raises(ValueError, match="groups"):
        plan_segments([[1]], [[1], [2]])


def test_segments_equal_the_pairwise_definition_on_random_pools():
    """Runs are maximal: sorted by source id, a pair joins the previous run exactly when
    both ids follow its last pair's."""
    rng = random.Random(7)
    for _ in range(200):
        pool = rng.sample(range(1, 400), rng.randint(0, 120))
        dst_pool = rng.sample(range(1, 400), len(pool))
        if rng.random() < 0.5:  # mostly consecutive, as a fresh pool hands them out
            dst_pool = sorted(dst_pool)
            pool = sorted(pool)
        cut = sorted(rng.sample(range(len(pool) + 1), 2)) if pool else [0, 0]
        src = [pool[: cut[0]], pool[cut[0] : cut[1]], pool[cut[1] :]]
        dst = [dst_pool[: cut[0]], dst_pool[cut[0] : cut[1]], dst_pool[cut[1] :]]
        expected: list[Segment] = []
        for a, b in sorted(zip(pool, dst_pool, strict=True)):
            last = expected[-1] if expected else None
            if last and a == last.src + last.length and b == last.dst + last.length:
                expected[-1] = Segment(last.src, last.dst, last.length + 1)
            else:
                expected.append(Segment(a, b, 1))
        assert plan_segments(src, dst) == expected


def test_pack_messages_bounds_bytes_and_regions():
    assert pack_messages([10] * 7, max_bytes=100, max_regions=3) == [3, 3, 1]
    assert pack_messages([40, 40, 40, 10], max_bytes=100, max_regions=8) == [2, 2]
    assert pack_messages([500, 10, 10], max_bytes=100, max_regions=8) == [1, 2]  # alone
    assert pack_messages([], max_bytes=100) == []
    with pytest.raises(ValueError):
        pack_messages([1], max_regions=0)
    regions = list("abcdef")
    assert group_regions(regions, [1, 3, 2]) == [["a"], ["b", "c", "d"], ["e", "f"]]
    for bad in ([1, 3], [1, 3, 3], [0, 6]):
        with pytest.raises(ValueError, match="message packing"):
            group_regions(regions, bad)


def test_paged_plan_rows_are_the_regions_addresses():
    """A plan over one pool gives each run's (address, bytes) row: the same bytes the
    region tensor of that run covers; ids outside the pool are refused."""
    pool = torch.zeros(10, 32, dtype=torch.uint8)
    plan = PagedPlan(PoolRegions(lambda: pool), 32)
    runs = [Segment(1, 7, 2), Segment(5, 0, 3)]
    for side, first in (("src", [1, 5]), ("dst", [7, 0])):
        iov, owner = plan.iov(runs, side)
        assert owner is pool and iov.dtype == np.uint64
        regions = [plan.region(f, s.length) for f, s in zip(first, runs, strict=True)]
        assert iov.tolist() == [[r.data_ptr(), r.numel()] for r in regions]
    with pytest.raises(ValueError, match="outside the pool"):
        plan.iov([Segment(9, 0, 2)], "src")
    assert PagedPlan(lambda b, n: pool[b : b + n], 32).iov(runs, "src") is None  # no pool
    assert PagedPlan(PoolRegions(lambda: pool), 16).iov(runs, "src") is None  # other pages
    msgs = split_iov(iov, pool, [1, 1])
    assert [m.iov.tolist() for m in msgs] == [[iov[0].tolist()], [iov[1].tolist()]]
    with pytest.raises(ValueError, match="message packing"):
        split_iov(iov, pool, [3])


def test_pull_packs_regions_as_decode_says():
    """`message_regions` from the puller: message i is a list of that many regions; a
    packing that does not cover the transfer sends nothing."""
    conn, _ = _late_keeper(keep_wait_s=0.0)
    conn.keep("r", "tok", ((1, 3, 5), (9,)))
    for bad in ([2, 3], [5]):
        with pytest.raises(TransferFailed, match="message packing"):
            conn.pull("r", "tok", [[20, 22, 24], [30]], b"peer", 64, message_regions=bad)
    assert not conn.transport.sent
    res = conn.pull("r", "tok", [[20, 22, 24], [30]], b"peer", 64, message_regions=[3, 1])
    assert res.messages == 2 and res.bytes == 4 * conn.layout.page_size_bytes
    assert conn.transport.sent[0][2] == [[(1, 1), (3, 1), (5, 1)], [(9, 1)]]
    assert conn.stats["messages_sent"] == 2


def test_params_round_trip_and_validation():
    p = KVTransferParams("r1", ((1, 2), (3,)), 10, 42, "prefill-x", "127.0.0.1:1", "f" * 32, "t")
    assert KVTransferParams.from_dict(p.to_dict()) == p
    bad = p.to_dict() | {"prompt_len": "10"}
    with pytest.raises(ValueError, match="prompt_len"):
        KVTransferParams.from_dict(bad)
    with pytest.raises(ValueError, match="block_ids"):
        KVTransferParams.from_dict(p.to_dict() | {"block_ids": [[0, 1]]})
    with pytest.raises(ValueError, match="JSON object"):
        KVTransferParams.from_dict([1, 2])
    with pytest.raises(ValueError, match="transfer_token"):
        KVTransferParams.from_dict(p.to_dict() | {"transfer_token": ""})


def test_params_round_trip_through_the_proto_exactly():
    # Several groups, one with nothing to ship (e.g. a window with only null blocks).
    p = KVTransferParams(
        "r1", ((1, 2, 3), (), (2**40,)), 10, 0, "prefill-x", "127.0.0.1:1", "f" * 32, "t"
    )
    wire = pb.KVTransferParams.FromString(p.to_pb().SerializeToString())
    assert [list(g.ids) for g in wire.block_ids] == [[1, 2, 3], [], [2**40]]
    assert KVTransferParams.from_pb(wire) == p
    assert KVTransferParams.from_pb(wire).to_pb() == wire
    assert KVTransferParams.from_dict(p.to_dict()) == KVTransferParams.from_pb(p.to_pb())


@pytest.mark.parametrize(
    "field, value",
    [
        ("request_id", ""),
        ("engine_id", ""),
        ("control_address", ""),
        ("fingerprint", ""),
        ("transfer_token", ""),
        ("prompt_len", 0),
        ("first_token", -1),
        ("block_ids", ((1,), (0, 2))),
        ("block_ids", ((-3,),)),
    ],
)
def test_params_from_the_proto_name_the_bad_field(field, value):
    p = KVTransferParams("r1", ((1, 2), (3,)), 10, 42, "prefill-x", "127.0.0.1:1", "f" * 32, "t")
    msg = replace(p, **{field: value}).to_pb()
    with pytest.raises(ValueError, match=rf"kv_transfer_params\.{field}"):
        KVTransferParams.from_pb(msg)


def test_layout_difference_names_the_field():
    a = KVLayout.of(plan_groups(model(), block_size=4), "m")
    assert a.difference(KVLayout.of(plan_groups(model(), block_size=4), "m")) is None
    b = KVLayout.of(plan_groups(model(), block_size=8), "m")
    assert "block_size is 4 here but 8" in a.difference(b)
    c = KVLayout.of(plan_groups(model(window=16), block_size=4), "m")
    assert "spec" in a.difference(c)
    assert "model" in a.difference(KVLayout.of(plan_groups(model(), block_size=4), "other"))
    assert a.fingerprint != b.fingerprint
    # A vLLM server's layout (the connector inside vLLM names its model "vllm:...").
    v = KVLayout.of(plan_groups(model(), block_size=4), "vllm:ckpt:Gemma3ForCausalLM")
    why = a.difference(v)
    assert "the peer runs vLLM and this worker hybrid-pd" in why
    assert "not supported" in why and "blocks of 4 tokens" in why


class _Req:
    def __init__(self, rid, prompt, out):
        self.request_id, self.prompt_ids, self.output_ids = rid, prompt, out


class _Recorder:
    """Stands in for UCX here: the subject is lease bookkeeping."""

    def __init__(self):
        self.sent = []

    def send(self, peer, tag, regions, timeout):
        self.sent.append((peer, tag, regions))


def make_connector(now):
    freed = []
    layout = KVLayout.of(plan_groups(model(), block_size=4), "m")
    conn = PrefillConnector(
        engine_id="p",
        layout=layout,
        control_address="127.0.0.1:9",
        free_blocks=freed.append,
        region=lambda b, n: (b, n),
        transport=_Recorder(),
        lease_s=10.0,
        clock=lambda: now[0],
    )
    return conn, freed


def test_lease_lifecycle_and_tokens():
    now = [100.0]
    conn, freed = make_connector(now)
    assert isinstance(conn, SupportsHMA)
    keep, params = conn.request_finished_all_groups(_Req("r", [1] * 9, [7]), ([1, 2, 3], [0, 4]))
    assert keep and params["block_ids"] == [[1, 2, 3], [4]] and params["first_token"] == 7
    with pytest.raises(TransferFailed, match="wrong transfer token"):
        conn.pull("r", "guess", [[5, 6, 7], [8]], b"peer", 0)
    assert conn.stats["bad_token"] == 1 and not conn.transport.sent
    res = conn.pull("r", params["transfer_token"], [[5, 6, 7], [8]], b"peer", 64)
    assert (res.messages, conn.transport.sent[0][2]) == (1, [(1, 4)])
    assert res.bytes == 4 * conn.layout.page_size_bytes
    now[0] += 9.0
    assert conn.heartbeat([("r", params["transfer_token"]), ("x", "y")]) == ["x"]
    now[0] += 9.0
    assert conn.expire() == 0  # the heartbeat extended the lease
    conn.release("r", params["transfer_token"])
    assert freed == ["r"] and conn.num_leases == 0
    with pytest.raises(TransferFailed, match="no KV kept"):
        conn.release("r", params["transfer_token"])
    assert freed == ["r"]  # freed exactly once


def test_lease_expiry_frees_once():
    now = [0.0]
    conn, freed = make_connector(now)
    _, params = conn.request_finished_all_groups(_Req("r", [1] * 4, [3]), ([1],))
    now[0] = 10.5
    assert conn.expire() == 1 and freed == ["r"]
    assert conn.expire() == 0 and freed == ["r"]
    with pytest.raises(TransferFailed):
        conn.pull("r", params["transfer_token"], [[2]], b"peer", 0)


def _late_keeper(keep_wait_s: float):
    """A prefill connector whose keeps arrive after the params went out (vLLM's order)."""
    freed: list[str] = []
    conn = PrefillConnector(
        engine_id="p",
        layout=KVLayout.of(plan_groups(model(), block_size=4), "m"),
        control_address="127.0.0.1:9",
        free_blocks=freed.append,
        region=lambda b, n: (b, n),
        transport=_Recorder(),
        keep_wait_s=keep_wait_s,
    )
    return conn, freed


def test_pull_waits_for_a_keep_still_on_its_way():
    conn, freed = _late_keeper(keep_wait_s=5.0)
    keeper = threading.Timer(0.3, conn.keep, args=("r", "tok", ((1, 2), ())))
    keeper.start()
    t0 = time.monotonic()
    res = conn.pull("r", "tok", [[5, 6], []], b"peer", 64)
    keeper.join()
    assert 0.2 < time.monotonic() - t0 < 4.0
    assert res.messages == 1 and conn.transport.sent[0][2] == [(1, 2)]
    conn.release("r", "tok")
    assert freed == ["r"]
    # Ended: a replayed pull fails at once instead of waiting.
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="no KV kept"):
        conn.pull("r", "tok", [[5, 6], []], b"peer", 64)
    assert time.monotonic() - t0 < 1.0


def test_pull_for_a_request_never_kept_fails_after_the_wait():
    conn, _ = _late_keeper(keep_wait_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="no KV kept"):
        conn.pull("nobody", "tok", [[5]], b"peer", 64)
    assert 0.25 < time.monotonic() - t0 < 3.0
    # Our own engine keeps before the params leave: no wait at all.
    conn0, _ = _late_keeper(keep_wait_s=0.0)
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="no KV kept"):
        conn0.pull("nobody", "tok", [[5]], b"peer", 64)
    assert time.monotonic() - t0 < 0.2


def test_abort_before_keep_frees_the_blocks_when_they_are_kept():
    conn, freed = _late_keeper(keep_wait_s=5.0)
    conn.release("r", "tok", reason="aborted")  # the decode worker dropped it first
    assert freed == [] and conn.num_leases == 0
    conn.keep("r", "tok", ((1, 2), (3,)))
    assert freed == ["r"] and conn.num_leases == 0
    assert conn.stats["aborted"] == 1 and conn.stats["handed_over"] == 1
    # An abort with the wrong token does not drop someone else's keep.
    conn.release("q", "forged", reason="aborted")
    conn.keep("q", "tok", ((4,), ()))
    assert freed == ["r"] and conn.num_leases == 1


def test_pull_skips_the_blocks_decode_holds():
    """`skip[g]`: decode holds group g's first kept blocks; only the rest are sent, paired
    with the destination blocks it lists; a skip outside the kept blocks is refused and
    sends nothing."""
    conn, _ = _late_keeper(keep_wait_s=0.0)
    conn.keep("r", "tok", ((1, 2, 3, 7), (9,)))
    res = conn.pull("r", "tok", [[22], [30]], b"peer", 64, skip=[3, 0])
    assert res.messages == 2 and [r for _, _, regs in conn.transport.sent for r in regs] == [
        (7, 1),
        (9, 1),
    ]
    sent = len(conn.transport.sent)
    for bad in ([5, 0], [-1, 0], [1]):
        with pytest.raises(TransferFailed):
            conn.pull("r", "tok", [[22], [30]], b"peer", 64, skip=bad)
    assert len(conn.transport.sent) == sent


def _staged_keeper():
    conn, freed = _late_keeper(keep_wait_s=0.0)
    kinds = [g.kind for g in conn.layout.groups]
    return conn, freed, kinds, kinds.index("full")


def test_staged_pulls_send_only_final_attention_blocks():
    """While the request computes, a decode worker showing its token follows it and pulls
    the attention blocks the engine published as final (full attention and the final
    window's); anything else, state pages included, is refused and sends nothing."""
    conn, _, kinds, full = _staged_keeper()
    n = len(kinds)
    window, state = kinds.index("sliding_window"), kinds.index("state")
    assert conn.progress("r", "tok").state == "waiting"  # its Prefill is on its way
    conn.stage_begin("r", "tok")
    with pytest.raises(TransferFailed, match="wrong transfer token"):
        conn.progress("r", "guess")
    blocks = [[] for _ in kinds]
    blocks[full], blocks[window], blocks[state] = [5, 6], [8], [9]
    conn.stage_progress("r", 9, blocks)
    p = conn.progress("r", "tok")
    assert (p.state, p.epoch, p.computed) == ("running", 1, 9)
    assert p.block_ids[full] == (5, 6) and p.block_ids[window] == (8,)
    assert p.block_ids[state] == ()  # a state page is never final before the end
    start, end, dst = [0] * n, [0] * n, [[] for _ in kinds]
    end[full], dst[full] = 2, [20, 21]
    end[window], dst[window] = 1, [22]
    res = conn.pull_stage("r", "tok", 1, start, end, dst, b"peer", 64)
    assert conn.transport.sent[-1][2] == [(5, 2), (8, 1)]
    assert res.bytes == 3 * conn.layout.page_size_bytes
    assert conn.stats["staged_pulls"] == 1 and conn.stats["staged_bytes"] == res.bytes
    sent = len(conn.transport.sent)
    end[full], dst[full] = 3, [20, 21, 23]  # a third block is not published yet
    with pytest.raises(TransferFailed, match="not final"):
        conn.pull_stage("r", "tok", 1, start, end, dst, b"peer", 64)
    bad_end, bad_dst = [0] * n, [[] for _ in kinds]
    bad_end[state], bad_dst[state] = 1, [30]
    with pytest.raises(TransferFailed, match="not final attention"):
        conn.pull_stage("r", "tok", 1, [0] * n, bad_end, bad_dst, b"peer", 64)
    with pytest.raises(TransferFailed, match="wrong transfer token"):
        conn.pull_stage("r", "guess", 1, start, [0] * n, [[] for _ in kinds], b"peer", 64)
    assert len(conn.transport.sent) == sent


def test_a_preemption_voids_staged_blocks_and_the_kept_lease_names_its_epoch():
    conn, freed, kinds, full = _staged_keeper()
    n = len(kinds)
    conn.stage_begin("r", "tok")
    blocks = [[] for _ in kinds]
    blocks[full] = [5, 6]
    conn.stage_progress("r", 8, blocks)
    start, end, dst = [0] * n, [0] * n, [[] for _ in kinds]
    end[full], dst[full] = 2, [20, 21]
    conn.stage_reset("r")  # preempted: its blocks were freed
    assert conn.progress("r", "tok").epoch == 2 and conn.progress("r", "tok").computed == 0
    with pytest.raises(TransferFailed, match="changed"):
        conn.pull_stage("r", "tok", 1, start, end, dst, b"peer", 64)
    assert not conn.transport.sent and conn.stats["staged_void"] == 1
    # Preempted while the bytes were on their way: sent, then reported void.
    conn.stage_progress("r", 8, blocks)
    real_send = conn.transport.send

    def send_then_preempt(*args):
        real_send(*args)
        conn.stage_reset("r")

    conn.transport.send = send_then_preempt
    with pytest.raises(TransferFailed, match="freed while sent"):
        conn.pull_stage("r", "tok", 2, start, end, dst, b"peer", 64)
    conn.transport.send = real_send
    assert len(conn.transport.sent) == 1 and conn.stats["staged_void"] == 2
    # Computed again under epoch 3 and kept: the lease carries the proxy's token, the
    # first token and the epoch, and a staged pull of its blocks still works.
    conn.stage_progress("r", 8, blocks)
    req = _Req("r", [1] * 8, [7])
    req.stage_token = "tok"
    _, params = conn.request_finished_all_groups(req, tuple(b or [9] for b in blocks))
    assert params["transfer_token"] == "tok"
    p = conn.progress("r", "tok")
    assert (p.state, p.epoch, p.first_token) == ("kept", 3, 7)
    conn.pull_stage("r", "tok", 3, start, end, dst, b"peer", 64)
    conn.release("r", "tok")
    assert freed == ["r"]
    # A staged request that ends without keeping (its first token finished it): "ended".
    conn.stage_begin("q", "tok2")
    conn.stage_end("q")
    assert conn.progress("q", "tok2").state == "ended"
