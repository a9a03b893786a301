"""KV-aware routing: the prefix index, and the pool's choice by prefix then load."""

from __future__ import annotations

import pytest

from hybrid_pd.proxy.config import ProxyConfig
from hybrid_pd.proxy.prefix_index import PrefixIndex, block_hashes
from hybrid_pd.proxy.routing import WorkerPool
from tests.proxy.test_units import StubClient, stats


def test_block_hashes_chain_whole_blocks():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the partial last block has no hash
    assert block_hashes(list(range(32)), 16) == a
    b = block_hashes([99, *range(1, 40)], 16)  # block 0 differs: every later hash differs
    assert all(x != y for x, y in zip(a, b, strict=True))
    c = block_hashes([*range(16), 99, *range(17, 40)], 16)
    assert c[0] == a[0] and c[1] != a[1]
    assert block_hashes(list(range(40)), 8)[:2] != a  # another block size, other keys
    assert block_hashes([1, 23], 2) != block_hashes([12, 3], 2)  # token boundaries count


def test_prefix_index_matches_leading_blocks_and_forgets():
    index = PrefixIndex(capacity=4)
    h = block_hashes(list(range(64)), 8)  # 8 hashes
    assert index.match("w", h) == 0
    index.record("w", h[:3])
    assert index.match("w", h) == 3 and index.match("v", h) == 0
    assert index.match("w", h[3:]) == 0 and index.match("w", [h[5], *h[:3]]) == 0
    index.record("w", h[3:6])  # capacity 4: the oldest two go
    assert index.size("w") == 4 and index.match("w", h) == 0
    index.record("w", h[:2])
    assert index.match("w", h) == 2  # blocks 2 and 3 went to make room: the chain breaks
    index.forget("w")
    assert index.match("w", h) == 0
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


def _decode_pool(kv_routing="prefix", max_imbalance=2):
    clients = [StubClient(a, {**stats(90), "block_size": 4}) for a in ("a:1", "b:1", "c:1")]
    pool = WorkerPool(
        [], clients, stats_interval_ms=0, kv_routing=kv_routing, max_imbalance=max_imbalance
    )
    return pool, pool.workers


def test_follow_up_goes_where_its_prefix_went_load_permitting():
    """Decode cost in tokens: those never sent to the worker + 0.5 x the request's tokens per
    stream it runs (block size 4)."""
    pool, w = _decode_pool()
    pool.refresh(force=True)  # as a pick does: the workers' block size is known
    turn1 = list(range(100, 141))
    assert pool.pick_decode((), turn1) is w["a:1"]  # nothing known: least loaded, by name
    pool.note_tokens(w["b:1"], [*turn1, 7, 8, 9])  # 44 tokens: 11 blocks
    turn2 = [*turn1, 7, 8, 9, 50, 51, 52, 53, 54, 55, 56, 57]  # 52 tokens
    assert pool.pick_decode((), turn2) is w["b:1"]  # costs a 52, b 8
    assert pool.pick_decode((), list(range(300, 340))) is w["a:1"]  # a stranger: by load
    pool.begin_decode(w["b:1"])
    assert pool.pick_decode((), turn2) is w["b:1"]  # b 8 + 26 = 34 < a 52
    pool.begin_decode(w["b:1"])
    assert pool.pick_decode((), turn2) is w["a:1"]  # b 8 + 52 = 60 > a 52: load wins
    pool.note_tokens(w["c:1"], turn2[:12])  # a shorter match elsewhere: c 40
    assert pool.pick_decode((), turn2) is w["c:1"]
    assert pool.pick_decode([w["c:1"]], turn2) is w["a:1"]
    pool.sync([], ["a:1", "b:1"])  # c left the pool: what it held is forgotten
    assert pool.prefixes.size("c:1") == 0


def test_new_chats_sharing_a_system_prompt_spread():
    """Four new conversations with one long system prompt, arriving together: the first
    records the prompt on its worker, yet they do not all pile onto it."""
    pool, _ = _decode_pool()
    pool.refresh(force=True)
    system = list(range(200))
    picked = []
    for chat in range(4):
        tokens = [*system, *range(1000 + 10 * chat, 1008 + 10 * chat)]
        choice = pool.pick_decode((), tokens)
        pool.note_tokens(choice, tokens)
        pool.begin_decode(choice)
        picked.append(choice.address)
    assert len(set(picked)) >= 2 and max(picked.count(a) for a in picked) <= 2


def test_max_imbalance_caps_the_preference():
    pool, w = _decode_pool(max_imbalance=0)
    pool.refresh(force=True)
    tokens = list(range(80))
    pool.note_tokens(w["b:1"], tokens)
    pool.begin_decode(w["b:1"])  # b 0 + 40 = 40 < a 80, but 1 request above a: capped
    assert pool.pick_decode((), tokens) is w["a:1"]


def test_load_routing_ignores_prefixes():
    pool, w = _decode_pool(kv_routing="load")
    tokens = list(range(64))
    pool.note_tokens(w["b:1"], tokens)
    assert pool.prefixes.size("b:1") == 0
    assert pool.pick_decode((), tokens) is w["a:1"]


def test_prefill_follows_prefix_within_imbalance():
    a = StubClient("a:1", {**stats(90), "block_size": 4})
    b = StubClient("b:1", {**stats(90), "block_size": 4})
    pool = WorkerPool([a, b], [], stats_interval_ms=0, max_imbalance=1)
    wa, wb = pool.workers["a:1"], pool.workers["b:1"]
    prompt = list(range(50))
    pool.refresh(force=True)  # as a pick does: the workers' block size is known
    pool.note_tokens(wb, prompt)
    assert pool.pick_prefill((), [*prompt, 1, 2, 3, 4]) is wb
    pool.begin_prefill(wb, 30)  # b: 6 missing + 30 queued < a: 54 missing
    assert pool.pick_prefill((), [*prompt, 1, 2, 3, 4]) is wb
    pool.begin_prefill(wb, 30)  # b: 2 prefills more than a: past max_imbalance 1
    assert pool.pick_prefill((), [*prompt, 1, 2, 3, 4]) is wa


def test_config_checks_the_policy():
    assert ProxyConfig().kv_routing == "prefix"
    with pytest.raises(ValueError, match="kv_routing"):
        ProxyConfig(kv_routing="random")
    with pytest.raises(ValueError, match="kv_routing_max_imbalance"):
        ProxyConfig(kv_routing_max_imbalance=-1)
    with pytest.raises(ValueError, match="kv_routing_load_weight"):
        ProxyConfig(kv_routing_load_weight=-0.5)
