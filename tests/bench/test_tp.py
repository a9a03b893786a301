"""`bench tp`'s core on a tiny checkpoint: P/D between TP 1 and 2 (real worker and rank
processes) is exact, each decode rank receives exactly the least it needs, nothing is
left behind; the throughput half gives positive figures for TP 1 and TP 2."""

from __future__ import annotations

import pytest

from hybrid_pd.bench import checkpoints
from hybrid_pd.bench.tp import bench_tp, summary
from hybrid_pd.bench.tp_pairs import parse_pairs, run_family
from hybrid_pd.bench.tp_throughput import GLOO_SETUP, SETUPS, compare


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return checkpoints.build("granite", tmp_path_factory.mktemp("bench-tp"), hidden=64)


def test_pairs_between_tp_sizes_are_exact_and_minimal(granite):
    rows = run_family("granite", granite, [(1, 2), (2, 1)], lengths=(16, 100), new_tokens=8)
    assert [r["pair"] for r in rows] == ["1-2", "2-1"]
    for r in rows:
        assert r["exact"] is True, r
        assert r["bytes_by_rank"] == r["min_bytes_by_rank"], r
        assert len(r["bytes_by_rank"]) == r["decode_tp"] and min(r["bytes_by_rank"]) > 0
        assert r["recomputed"] is False
        assert r["leaked_blocks"] == {"prefill": 0, "decode": 0} and r["clean"]
        assert r["messages"] >= 1 and r["handoff_ms"] > 0
        assert r["reference_distinct_tokens"] >= 8, "the reference output does not vary"


def test_throughput_tp1_vs_tp2_gives_positive_figures(granite):
    setups = (*SETUPS, GLOO_SETUP)
    rows = compare("granite", granite, [1, 2], prompt_len=32, new_tokens=4, reps=1, setups=setups)
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        for setup in ("tp1", "tp2", "tp2_gloo"):
            assert r[setup]["prefill_median"] > 0 and r[setup]["decode_median"] > 0
            assert len(r[setup]["prefill_tokens_per_s"]) == 1
        assert r["prefill_ratio"] > 0 and r["decode_ratio"] > 0
        assert r["gloo_prefill_ratio"] > 0 and r["gloo_decode_ratio"] > 0
        # TP 2 ran on shared memory, the baseline on gloo, and both gave TP 1's tokens
        assert [r[s]["collectives"] for s in ("tp1", "tp2", "tp2_gloo")] == ["none", "shm", "gloo"]
        assert r["tokens_equal"] is True


def test_parse_pairs_and_unknown_family():
    assert parse_pairs("1-1, 2-1") == [(1, 1), (2, 1)]
    for bad in ("1", "a-1", "0-1", ""):
        with pytest.raises(ValueError):
            parse_pairs(bad)
    with pytest.raises(ValueError, match="unknown family"):
        bench_tp(["nope"], [(1, 1)])


def test_summary_prints_every_row():
    row = {
        "family": "granite",
        "pair": "1-2",
        "exact": True,
        "bytes_by_rank": [2048, 2048],
        "min_bytes_by_rank": [2048, 2048],
        "messages": 1.0,
        "handoff_ms": 3.0,
        "recomputed": False,
        "leaked_blocks": {"prefill": 0, "decode": 0},
        "reference_distinct_tokens": 9,
        "reference_tokens": 10,
    }
    setup = {"prefill_median": 100.0, "decode_median": 10.0}
    thr = {"family": "granite", "batch_size": 8, "tp1": setup, "tp2": setup}
    thr |= {"prefill_ratio": 1.0, "decode_ratio": 1.0, "tokens_equal": True}
    meta = {"all_exact": True, "all_min_bytes": True, "all_clean": True}
    meta |= {"any_recomputed": False, "seconds": 1.0}
    text = summary({"pairs": [row], "throughput": [thr], "meta": meta})
    assert "granite    1-2   True  2.0/2.0 KiB" in text and "100 -> 100 (1.0x)" in text


def test_an_unknown_real_shape_is_refused_by_name_before_any_run():
    with pytest.raises(ValueError, match="unknown real shape 'granite-9t-like'"):
        bench_tp([], [], throughput_models=["granite-9t-like"])
