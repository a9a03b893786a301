"""Pure parts of the proxy: config, routing helpers, worker picking, detokenization, parsing."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest

from hybrid_pd.api.card import ModelCard, ModelIdentity
from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.api.tokenizer import Tokenizer
from hybrid_pd.api.wire import card_from_pb, card_to_pb
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proxy.calls import (
    prepare_decode_request,
    prepare_prefill_request,
    wants_prefill,
)
from hybrid_pd.proxy.config import ProxyConfig
from hybrid_pd.proxy.detok import TextStream
from hybrid_pd.proxy.errors import ProxyError
from hybrid_pd.proxy.protocol import ModelContext, parse_chat, parse_completion
from hybrid_pd.proxy.routing import WorkerPool
from hybrid_pd.proxy.worker_client import PrefillResult, prefill_result, stats_from_pb
from hybrid_pd.workers.service import stats_to_pb

pytestmark = pytest.mark.timeout(60)


# -- config ---------------------------------------------------------------------------------
def test_config_defaults_and_validation():
    c = ProxyConfig(decode_addresses=["127.0.0.1:1"])
    assert (c.host, c.port, c.served_model_names, c.min_prefill_tokens) == (
        "127.0.0.1",
        8000,
        (),
        32,
    )
    assert ProxyConfig(served_model_names="a").served_model_names == ("a",)
    assert ProxyConfig(served_model_names=["a", "b", "a"]).served_model_names == ("a", "b")
    assert c.decode_addresses == ("127.0.0.1:1",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.port = 1  # type: ignore[misc]
    for bad in (
        {"port": 70000},
        {"port": -1},
        {"host": ""},
        {"served_model_names": (" ",)},
        {"served_model_names": ("a", 3)},
        {"min_prefill_tokens": -1},
        {"prefill_addresses": ("nohost",)},
        {"decode_addresses": ("h:notaport",)},
        {"request_timeout_s": 0},
        {"stream_idle_timeout_s": -1},
        {"failure_policy": "retry"},
        {"max_model_len": 1},
    ):
        with pytest.raises(ValueError):
            ProxyConfig(**bad)


def test_model_card_names_and_wire():
    card = ModelCard(
        "/ckpt/my-model/", "/ckpt/my-model", "X", 4096, 300, (2, 7), ModelIdentity("X", 9, "ab")
    )
    assert card.default_name == "my-model"
    assert ModelCard("tiny", "/c/t", "X", 4096, None).default_name == "tiny"
    assert card_from_pb(card_to_pb(card)) == card
    assert card_from_pb(card_to_pb(dataclasses.replace(card, vocab_size=None))).vocab_size is None
    for bad in ({"max_model_len": 1}, {"vocab_size": 0}):
        with pytest.raises(ValueError):
            dataclasses.replace(card, **bad)


# -- request pieces -------------------------------------------------------------------------
def test_prepare_requests():
    params = SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop=("x",))
    p = prepare_prefill_request("r", [1, 2, 3], params, attempt=1)
    assert p.request_id == "r-p1" and p.prompt_ids == [1, 2, 3]
    assert p.sampling.max_tokens == 5 and p.sampling.has_seed and list(p.sampling.stop) == ["x"]
    d = prepare_decode_request("r", [1, 2, 3], params)
    assert d.request_id == "r-d0" and d.kv_transfer_params is None
    kv = KVTransferParams("r-p1", ((4,),), 3, 9, "prefill-x", "127.0.0.1:1", "f" * 32, "t")
    d = prepare_decode_request("r", [1, 2, 3], params, PrefillResult(9, False, "", kv), "fail")
    assert d.kv_transfer_params == kv and d.failure_policy == "fail"
    with pytest.raises(ValueError):
        prepare_decode_request("r", [1, 2], params, PrefillResult(9, False, "", kv))
    with pytest.raises(ValueError):
        prepare_decode_request("r", [1, 2, 3], params, PrefillResult(9, True, "stop", None))
    with pytest.raises(ValueError):
        prepare_prefill_request("r", [], params)
    assert wants_prefill(32, 32, 1) and not wants_prefill(31, 32, 1)
    assert not wants_prefill(100, 32, 0)


def test_prefill_reply_params_are_parsed_at_the_edge():
    kv = KVTransferParams("r-p0", ((1, 2), ()), 3, 9, "prefill-x", "127.0.0.1:1", "f" * 32, "t")
    reply = pb.PrefillReply(first_token=9, kv_transfer_params=kv.to_pb())
    wire = pb.PrefillReply.FromString(reply.SerializeToString())
    assert prefill_result(wire) == PrefillResult(9, False, "", kv)
    done = prefill_result(pb.PrefillReply(first_token=2, finished=True, finish_reason="stop"))
    assert done.kv_transfer_params is None and done.finished
    bad = pb.PrefillReply(kv_transfer_params=dataclasses.replace(kv, prompt_len=0).to_pb())
    with pytest.raises(ValueError, match="prompt_len"):
        prefill_result(bad)


# -- worker stats on the wire ---------------------------------------------------------------
def worker_stats(role: str) -> dict:
    """What `Worker.stats()` returns (its keys, its value types) for `role`."""
    out = {
        "num_blocks": 64,
        "free_blocks": 60,
        "cached_blocks": 2,
        "kv_requests": 1,
        "running": 1,
        "waiting": 0,
        "receiving": 0,
        "integrity": "ok",
        "published_at": 1700000000.25,
        "engine_id": f"{role}-0123456789",
        "role": role,
        "address": "127.0.0.1:5000",
        "model": "tiny",
        "page_size_bytes": 4096,
        "block_size": 16,
        "cpu_kernels": "on",
        "tensor_parallel_size": 2,
    }
    if role in ("prefill", "both"):
        out["leases"] = 2
        out["prefill_connector"] = dict.fromkeys(
            ("handed_over", "pulled", "released", "expired", "aborted", "bad_token"), 1
        ) | {"bytes_sent": 1 << 40, "messages_sent": 7, "staged": 2, "staged_pulls": 5}
        out["prefill_connector"] |= {"staged_bytes": 1 << 30, "staged_void": 1, "read_pulls": 4}
    if role in ("decode", "both"):
        out["decode_connector"] = {
            "pulls": 3,
            "failed": 1,
            "bytes": 1 << 33,
            "messages": 9,
            "seconds": 0.5,
            "last_error": "wrong transfer token",
            "held_blocks": 4,
            "staged_loads": 2,
            "staged_pulls": 5,
            "staged_bytes": 1 << 30,
            "staged_void": 1,
            "bytes_by_rank": [1 << 32, 1 << 32],
        }
        out["peers"] = ["127.0.0.1:5001", "127.0.0.1:5002"]
    out["transport"] = {
        k: i
        for i, k in enumerate(
            (
                "messages_sent",
                "bytes_sent",
                "messages_received",
                "bytes_received",
                "send_failures",
                "recv_failures",
                "drained",
                "endpoints",
                "pending_ops",
                "orphan_sends",
                "drain_pending",
                "messages_read",
                "bytes_read",
                "get_failures",
            )
        )
    }
    return out


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_stats_cross_the_wire_typed(role):
    stats = worker_stats(role)
    reply = pb.StatsReply.FromString(stats_to_pb(stats).SerializeToString())
    assert reply.HasField("prefill") == (role != "decode")
    assert reply.HasField("decode") == (role != "prefill")
    assert (reply.free_blocks, reply.block_size, reply.integrity) == (60, 16, "ok")
    back = stats_from_pb(reply)
    assert back == stats
    # Same types as the worker's dict: counters stay ints, times floats.
    assert {k: type(v) for k, v in back.items()} == {k: type(v) for k, v in stats.items()}


def test_stats_schema_follows_the_worker():
    """A counter the proto does not know fails loudly instead of vanishing."""
    stats = worker_stats("prefill")
    stats["prefill_connector"]["new_counter"] = 1
    with pytest.raises(ValueError, match="new_counter"):
        stats_to_pb(stats)
    with pytest.raises(ValueError, match="new_field"):
        stats_to_pb(worker_stats("decode") | {"new_field": 1})


# -- worker picking -------------------------------------------------------------------------
class RpcFailure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()


class StubClient:
    """Stats from a dict; None: the connection is refused; a StatusCode: that error."""

    def __init__(self, address, stats=None):
        self.address = address
        self._stats = stats
        self.stats_calls = 0

    def stats(self, timeout_s=None):
        self.stats_calls += 1
        if self._stats is None:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE)
        if isinstance(self._stats, grpc.StatusCode):
            raise RpcFailure(self._stats)
        return dict(self._stats)

    def close(self):
        pass


def stats(free, running=0, waiting=0, total=100):
    return {"free_blocks": free, "num_blocks": total, "running": running, "waiting": waiting}


def test_pick_prefill_by_outstanding_tokens():
    a, b = StubClient("a:1", stats(99)), StubClient("b:1", stats(99))
    pool = WorkerPool([a, b], [], stats_interval_ms=0)
    wa, wb = pool.workers["a:1"], pool.workers["b:1"]
    pool.begin_prefill(wa, 500)
    assert pool.pick_prefill() is wb
    pool.begin_prefill(wb, 600)
    assert pool.pick_prefill() is wa
    assert pool.pick_prefill(exclude=[wa]) is wb
    pool.end_prefill(wb, 600)
    assert pool.pick_prefill() is wb
    pool.mark_failed(wb, "UNAVAILABLE")
    pool.stats_interval_s = 60  # no refresh: the failure stands
    assert pool.pick_prefill() is wa
    assert pool.pick_prefill(exclude=[wa]) is None


def test_pick_decode_by_health_blocks_and_load():
    full = StubClient("full:1", stats(5, running=0))
    busy = StubClient("busy:1", stats(80, running=6))
    idle = StubClient("idle:1", stats(60, running=1))
    down = StubClient("down:1", None)
    pool = WorkerPool([], [full, busy, idle, down], stats_interval_ms=0)
    assert pool.pick_decode().address == "idle:1"
    w = pool.workers
    for _ in range(7):  # the proxy's own open streams count even before Stats show them
        pool.begin_decode(w["idle:1"])
    assert pool.pick_decode().address == "busy:1"
    assert pool.pick_decode(exclude=[w["busy:1"], w["idle:1"]]).address == "full:1"
    assert pool.pick_decode(exclude=[w["busy:1"], w["idle:1"], w["full:1"]]) is None
    assert not w["down:1"].healthy and w["down:1"].last_error
    assert pool.decode_available()


def test_stats_refresh_interval():
    c = StubClient("a:1", stats(10))
    pool = WorkerPool([], [c], stats_interval_ms=60_000)
    pool.pick_decode()
    pool.pick_decode()
    assert c.stats_calls == 1
    pool.refresh(force=True)
    assert c.stats_calls == 2
    snap = pool.snapshot()
    assert snap[0]["roles"] == ["decode"] and snap[0]["free_blocks"] == 10


def test_same_address_in_both_roles_is_one_worker():
    pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:1"])
    try:
        assert len(pool.workers) == 1
        assert pool.workers["127.0.0.1:1"].roles == {"prefill", "decode"}
    finally:
        pool.close()


# -- detokenization -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer(tiny_path)


def test_text_stream_holds_back_partial_utf8_and_stop_prefixes(tok):
    ids = tok.encode("ab é xyz!")
    s = TextStream(tok, ("xyz",))
    out = [s.push([t]) for t in ids]
    assert "".join(out) == "ab é "
    assert s.stopped and "\ufffd" not in "".join(out)
    s = TextStream(tok, ("xyq",))
    text = "".join(s.push([t]) for t in ids) + s.flush()
    assert text == "ab é xyz!" and not s.stopped
    s = TextStream(None, ("x",))
    assert s.push([1, 2]) == "" and s.flush() == "" and s.token_ids == [1, 2]


# -- parsing --------------------------------------------------------------------------------
def test_parse_requests(tok):
    ctx = ModelContext(("tiny",), tok, 100, 512, default_chat_max_tokens=50)
    r = parse_completion({"model": "tiny", "prompt": [[1, 2, 3]], "stop": "x"}, ctx)
    assert r.prompt_ids == [1, 2, 3] and r.params.max_tokens == 16
    assert r.params.stop == ("x",) and r.params.temperature == 1.0 and not r.stream
    r = parse_completion(
        {
            "model": "tiny",
            "prompt": "hi",
            "top_k": -1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        },
        ctx,
    )
    assert r.params.top_k == 0 and r.stream and r.include_usage and r.params.greedy
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    r = parse_chat(chat, ctx)
    assert tok.decode(r.prompt_ids).startswith("<|user|>\nhi")
    assert r.params.max_tokens == 50  # the chat default, within the room left
    r = parse_chat({**chat, "max_completion_tokens": 7, "max_tokens": 9}, ctx)
    assert r.params.max_tokens == 7
    with pytest.raises(ProxyError) as e:
        parse_completion({"model": "tiny", "prompt": [1] * 90, "max_tokens": 20}, ctx)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(ProxyError) as e:
        parse_completion({"model": "other", "prompt": "x"}, ctx)
    assert e.value.status == 404 and "tiny" in e.value.message


def test_slow_worker_is_not_dead_until_it_fails_for_a_while():
    """Stats timing out is busy, not dead: the worker stays pickable until its checks have
    failed for dead_after_s; a refused connection counts at once."""
    slow = StubClient("slow:1", grpc.StatusCode.DEADLINE_EXCEEDED)
    pool = WorkerPool([], [slow], stats_interval_ms=0, dead_after_s=0.3)
    w = pool.workers["slow:1"]
    assert pool.pick_decode() is w and w.healthy and "DEADLINE_EXCEEDED" in w.last_error
    time.sleep(0.35)
    assert pool.pick_decode() is None and not w.healthy
    slow._stats = stats(50)
    assert pool.pick_decode() is w and w.healthy  # back: answered again
    slow._stats = None
    assert pool.pick_decode() is None and not pool.live("decode")


def test_full_worker_is_skipped_for_a_moment():
    a, b = StubClient("a:1", stats(90)), StubClient("b:1", stats(10))
    pool = WorkerPool([], [a, b], stats_interval_ms=0)
    wa = pool.workers["a:1"]
    assert pool.pick_decode() is wa
    pool.mark_full(wa)
    assert pool.pick_decode().address == "b:1" and pool.live("decode")
    time.sleep(0.15)
    assert pool.pick_decode() is wa
