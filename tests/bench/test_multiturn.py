"""`hybrid-pd bench multiturn` on the tiny model: decode-side prefix reuse on and off."""

from __future__ import annotations

import json

import pytest

from hybrid_pd.bench.multiturn import _round_stats, _routing, bench_multiturn

CONVERSATIONS, TURNS, SYSTEM_LEN, USER_LEN, MAX_TOKENS = 2, 3, 200, 16, 8


def test_round_stats_and_routing():
    before = [
        {"bytes": 0, "held_blocks": 0, "loads": 0, "page_size_bytes": 100},
        {"bytes": 500, "held_blocks": 2, "loads": 1, "page_size_bytes": 100},
    ]
    after = [
        {"bytes": 300, "held_blocks": 1, "loads": 1, "page_size_bytes": 100},
        {"bytes": 500, "held_blocks": 2, "loads": 1, "page_size_bytes": 100},
    ]
    out = _round_stats(before, after)
    assert out == {
        "bytes_pulled": 300,
        "held_blocks": 1,
        "hit_rate_by_worker": {"decode-0": 0.25, "decode-1": None},
    }
    assert _routing([[0, 0, 1, 1]])["same_decode_worker_fraction"] == round(2 / 3, 4)
    assert _routing([[None, None], [None, None]])["same_decode_worker_fraction"] is None


def test_worker_flag_turns_reuse_off():
    from hybrid_pd.workers.main import parse_args

    assert parse_args(["--role", "decode"]).reuse_prefix_on_load is True
    args = parse_args(["--role", "decode", "--no-prefix-reuse-on-load"])
    assert args.reuse_prefix_on_load is False


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_multiturn_reuse_pulls_less(tmp_path, monkeypatch):
    pytest.importorskip("httpx")
    monkeypatch.setenv("HYBRID_PD_CACHE", str(tmp_path / "cache"))
    result = bench_multiturn(
        "tiny",
        conversations=CONVERSATIONS,
        turns=TURNS,
        system_len=SYSTEM_LEN,
        user_len=USER_LEN,
        max_tokens=MAX_TOKENS,
        prefill_workers=1,
        # One decode worker: every turn >= 2 lands where the system prompt is cached, whatever
        # the routing, so the lower bounds below hold.
        decode_workers=1,
        setups=("reuse", "no-reuse"),
        max_seconds=120,
        kv_memory="16MiB",
        env={"HYBRID_PD_CACHE": str(tmp_path / "cache")},
        progress=False,
    )
    json.dumps(result)  # serializable as printed by --json
    assert result["config"]["conversations"] == CONVERSATIONS
    assert set(result["setups"]) == {"reuse", "no-reuse"}
    assert result["errors"] == 0 and result["no_leaks"]
    for setup, s in result["setups"].items():
        assert [r["turn"] for r in s["turns"]] == list(range(1, TURNS + 1)), setup
        for r in s["turns"]:
            assert r["errors"] == 0 and r["requests"] == CONVERSATIONS, (setup, r)
            assert 0 < r["ttft_ms_median"] <= r["ttft_ms_p90"], (setup, r)
            assert r["bytes_pulled"] > 0, (setup, r)
        assert [w["role"] for w in s["workers"]] == ["prefill", "decode"]
        # read from the proxy's access log: one decode worker served every turn
        assert s["routing"]["same_decode_worker_fraction"] == 1.0
        assert s["routing"]["decode_worker_by_turn"] == [[0] * TURNS] * CONVERSATIONS
        for w in s["workers"]:
            assert w["clean"] and w["leaked_blocks"] == 0 and w["leases"] == 0, (setup, w)
    reuse, plain = result["setups"]["reuse"], result["setups"]["no-reuse"]
    assert reuse["prefix_reuse_on_load"] and not plain["prefix_reuse_on_load"]
    page = reuse["decode_layout"]["page_size_bytes"]
    bs = reuse["decode_layout"]["block_size"]
    # Each turn >= 2 finds at least the system prompt's whole blocks (in the one full-attention
    # group at least) in the decode worker's prefix cache.
    bound = CONVERSATIONS * (SYSTEM_LEN // bs)
    assert bound > 0
    for r, p in zip(reuse["turns"], plain["turns"], strict=True):
        assert p["held_blocks"] == 0, p
        # Answers have a fixed length, so both setups' prompts are equally long and move the
        # same blocks in all; reuse skips exactly the held ones.
        assert p["bytes_pulled"] == r["bytes_pulled"] + r["held_blocks"] * page, (r, p)
        if r["turn"] == 1:
            # The conversations share the system prompt: one whose first turn reaches decode
            # after another's has been committed there finds its whole system blocks (only
            # those); the first to arrive finds none.
            assert r["held_blocks"] <= (CONVERSATIONS - 1) * (SYSTEM_LEN // bs), r
        else:
            assert r["held_blocks"] >= bound, (r, bound)
            assert p["bytes_pulled"] - r["bytes_pulled"] >= bound * page, (r, p)
            assert 0 < r["hit_rate_by_worker"]["decode-0"] < 1, r
            assert p["hit_rate_by_worker"]["decode-0"] == 0, p
