"""bench serve --peer: how repetitions become medians and how greedy ids are compared (the
whole bench against a real vLLM server is tests/vllm_connector/test_bench_serve_peer.py)."""

from __future__ import annotations

from hybrid_pd.bench.serve_peer import _greedy_agreement, _median_rows, rep_prompts


def _row(c, tps, errors=0, ids=None):
    row = {"concurrency": c, "output_tokens_per_s": tps, "ttft_ms_p50": None, "errors": errors}
    row["error_samples"] = ["boom"] if errors else []
    if ids is not None:
        row["token_ids"] = ids
    return row


def test_medians_per_level_and_errors_summed():
    reps = [[_row(1, 10.0), _row(8, 50.0, errors=1)], [_row(1, 14.0), _row(8, 40.0)]]
    got = _median_rows(reps)
    assert [r["concurrency"] for r in got] == [1, 8]
    assert got[0]["output_tokens_per_s"] == 12.0 and got[1]["output_tokens_per_s"] == 45.0
    assert got[0]["ttft_ms_p50"] is None  # no rep had a figure
    assert got[1]["errors"] == 1 and got[1]["error_samples"] == ["boom"]


def test_greedy_agreement_names_where_requests_part():
    ours = [[_row(1, 1.0, ids={0: [5, 6, 7], 1: [1, 2, 3], 2: [4]}), _row(4, 1.0, ids={0: [9]})]]
    vllm = [[_row(1, 1.0, ids={0: [5, 6, 7], 1: [1, 9, 3]}), _row(4, 1.0, ids={0: [9, 9]})]]
    got = _greedy_agreement({"ours": ours, "vllm": vllm})
    # request 2 ran only on our side: not compared
    assert got["compared"] == 3 and got["equal"] == 1
    assert got["differing"] == [
        {"concurrency": 1, "request": 1, "first_token": 1},
        {"concurrency": 4, "request": 0, "first_token": 1},
    ]


def test_every_repetition_and_level_gets_prompts_of_its_own():
    # a prompt seen in an earlier repetition would hit our prefix cache (the vLLM server runs
    # without one): each repetition is cold on both sides
    first, again = rep_prompts([1, 8], 4, 16, 32000, 0), rep_prompts([1, 8], 4, 16, 32000, 0)
    second = rep_prompts([1, 8], 4, 16, 32000, 1)
    assert first == again  # both sides of one repetition get the same ids
    every = [tuple(p) for rep in (first, second) for level in rep.values() for p in level]
    assert len(every) == 16 and len(set(every)) == 16
    assert all(len(p) == 16 and all(1000 <= t < 32000 for t in p) for p in every)
