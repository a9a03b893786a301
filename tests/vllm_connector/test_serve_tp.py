"""`hybrid-pd serve --engine vllm` with tensor-parallel pools: a TP-2 prefill server and a
TP-1 decode server (Granite-4.0-H-like: Mamba2 with n_groups = 1, one KV head) on
embedded Ray in a network namespace of its own (Ray and every server see only loopback).
Through the proxy's OpenAI API, greedy output equals the decode server's alone, and the
connector's counters on both servers show every prompt's KV read one-sided and released on
every prefill rank, none recomputed.

Collected only with HYBRID_PD_VLLM_TP=1, like test_tp.py (conftest.py says why); then it
runs TP 2 -> 1 and TP 1 -> 2, about 80 s each on two cores."""

from __future__ import annotations

import os
import shutil

import pytest

from hybrid_pd.launcher.vllm_slots import rank_binds
from tests.vllm_connector.serve_scenario import run_isolated

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("unshare") is None or os.geteuid() != 0,
        reason="needs root and unshare for a private network namespace",
    ),
]

LENGTHS = (5, 60)
PAIRS = [(2, 1), (1, 2)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS)
def test_serve_tp_pools_hand_over(tmp_path, prefill_tp, decode_tp):
    result = run_isolated(
        tmp_path,
        "tests.vllm_connector.serve_scenario",
        f"--family granite --prefill-tp {prefill_tp} --decode-tp {decode_tp} --max-tokens 8",
        f"--lengths {','.join(map(str, LENGTHS))}",
        timeout=600,
    )
    assert result["distinct"], "random weights too flat to tell"
    assert result["equal"], result
    n = len(LENGTHS)
    assert result["disaggregated"] == [float(n)], result
    # each prompt: two reads (TP 2 -> 1: decode's rank from both prefill ranks, Mamba2
    # heads split over them; TP 1 -> 2: each decode rank from the prefill's one), none
    # failed over to recomputing; prefill saw both confirmed and every rank released
    decode, prefill = result["decode"], result["prefill"]
    assert (
        decode.get("hybrid_pd_kv_pulls_total"),
        decode.get("hybrid_pd_kv_pull_failures_total", 0),
    ) == (2.0 * n, 0.0), result
    assert prefill.get("hybrid_pd_kv_read_pulls_total") == 2.0 * n, result
    assert prefill.get("hybrid_pd_kv_released_total") == float(prefill_tp * n), result
    assert decode["hybrid_pd_kv_bytes_pulled_total"] == prefill["hybrid_pd_kv_bytes_sent_total"] > 0
    # the three ranks' CPUs: a server's two ranks apart, as rank_binds put them
    cpus = sorted(os.sched_getaffinity(0))
    want = rank_binds(cpus, [prefill_tp, decode_tp])
    assert result["cpus"] == {"prefill-0": want[0], "decode-0": want[1]}
    assert all(len(set(b.split("|"))) == len(b.split("|")) for b in want)


def test_a_tp_prefill_rank_killed_takes_its_worker_down_and_it_comes_back_whole(tmp_path):
    """test_serve_rank_death.py's scenario with a TP-2 prefill server: its rank 1 killed."""
    from tests.vllm_connector.test_serve_rank_death import run_rank_death

    run_rank_death(tmp_path, prefill_tp=2)
