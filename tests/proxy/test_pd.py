"""The disaggregated path through the proxy: Prefill on one worker, KV over UCX, Generate on
another; outputs equal one engine, and the KV bytes moved show in /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from hybrid_pd.engine.sampling import SamplingParams
from tests.proxy.conftest import assert_no_leaks, make_proxy
from tests.proxy.fakes import FakeWorker
from tests.proxy.test_failures import metric

pytestmark = pytest.mark.timeout(120)

LONG = [(11 * i + 5) % 250 for i in range(70)]  # >= min_prefill_tokens (32)


@pytest.fixture(scope="module")
def pd_workers(workers):
    """(prefill worker, decode worker): both processes are of role `both`."""
    return workers[0], workers[1]


@pytest.fixture(scope="module")
def pd_proxy(tiny_path, pd_workers):
    handle = make_proxy(
        tiny_path,
        prefill_addresses=(pd_workers[0].address,),
        decode_addresses=(pd_workers[1].address,),
    )
    yield handle
    handle.stop()
    handle.pool.close()


def test_disaggregated_equals_single_engine(pd_proxy, pd_workers, workers, reference):
    want = reference.generate([LONG], SamplingParams(max_tokens=10))[0]
    body = {
        "model": "tiny",
        "prompt": LONG,
        "max_tokens": 10,
        "temperature": 0,
        "return_token_ids": True,
    }
    with httpx.Client(base_url=pd_proxy.url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
        assert r.json()["choices"][0]["text"] == want.text
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            chunks = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
        streamed = [t for ln in chunks for t in json.loads(ln[6:])["choices"][0]["token_ids"]]
        assert streamed == want.token_ids
        # A short prompt skips the prefill pool.
        short = {**body, "prompt": LONG[:8]}
        assert c.post("/v1/completions", json=short).status_code == 200
        text = c.get("/metrics").text
    assert metric(text, 'hybrid_pd_proxy_routes_total{route="disaggregated"}') == 2
    assert metric(text, 'hybrid_pd_proxy_routes_total{route="decode_only"}') == 1
    assert metric(text, 'hybrid_pd_proxy_kv_transfers_total{result="pulled"}') == 2
    assert metric(text, "hybrid_pd_proxy_kv_transfer_bytes_total") > 0
    assert metric(text, "hybrid_pd_proxy_kv_transfer_seconds_count") == 2
    assert_no_leaks(workers)


def test_disconnect_mid_stream_frees_both_workers(pd_proxy, workers):
    body = {
        "model": "tiny",
        "prompt": LONG,
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=pd_proxy.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    assert_no_leaks(workers, 4.0)


def test_prefill_retried_on_another_worker(tiny_path, workers, pd_workers, reference):
    """The first prefill worker is unavailable: the second one prefills, decode pulls."""
    down = FakeWorker(prefill="unavailable")
    prefill, decode = pd_workers
    handle = make_proxy(
        tiny_path,
        prefill_addresses=(down.address, prefill.address),
        decode_addresses=(decode.address,),
    )
    try:
        # Steer the first pick to the fake: the real one looks busier.
        handle.pool.workers[prefill.address].outstanding_prefill_tokens += 10**6
        want = reference.generate([LONG], SamplingParams(max_tokens=5))[0].token_ids
        body = {
            "model": "tiny",
            "prompt": LONG,
            "max_tokens": 5,
            "temperature": 0,
            "return_token_ids": True,
        }
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want
            text = c.get("/metrics").text
        assert [k for k, _ in down.calls].count("prefill") == 1
        assert metric(text, 'hybrid_pd_proxy_failures_total{kind="prefill_unavailable"}') == 1
        assert metric(text, 'hybrid_pd_proxy_routes_total{route="disaggregated"}') == 1
        assert_no_leaks(workers)
    finally:
        handle.stop()
        handle.pool.close()
        down.stop()


def test_logprobs_echo_and_n_are_exact_over_pd(pd_proxy, workers, reference):
    """Logprobs (prompt ones from the prefill worker, the first token's from its sampler,
    the rest from decode), echo, n > 1 and prompt scoring equal one in-process engine."""
    params = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=2)
    want = reference.generate([LONG], params)[0]
    tok = reference.tokenizer
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    with httpx.Client(base_url=pd_proxy.url, timeout=60) as c:
        r = c.post("/v1/completions", json={**body, "echo": True})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        ids = LONG + want.token_ids
        assert lp["tokens"] == [tok.token_text(t) for t in ids]
        expected = [None] + [x.logprob for x in want.prompt_logprobs[1:]]
        expected += [x.logprob for x in want.logprobs]
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(expected[1:], abs=1e-5)
        for top, x in zip(lp["top_logprobs"][1 : len(LONG)], want.prompt_logprobs[1:], strict=True):
            assert len(top) >= 2 and max(top.values()) == pytest.approx(x.top[0][1], abs=1e-5)
        assert r.json()["choices"][0]["text"] == tok.decode(LONG) + want.text
        # Streamed: the same output logprobs, chunk by chunk.
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        streamed = [
            v
            for e in events
            if e["choices"][0]["logprobs"]
            for v in e["choices"][0]["logprobs"]["token_logprobs"]
        ]
        assert streamed == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
        # Prompt scoring (max_tokens 0 with echo): the prompt only, nothing generated.
        score = c.post("/v1/completions", json={**body, "echo": True, "max_tokens": 0}).json()
        assert score["usage"]["completion_tokens"] == 0
        assert len(score["choices"][0]["logprobs"]["token_logprobs"]) == len(LONG)
        # n choices, greedy: all the engine's tokens.
        many = c.post("/v1/completions", json={**body, "n": 3, "return_token_ids": True}).json()
        assert [ch["index"] for ch in many["choices"]] == [0, 1, 2]
        assert all(ch["token_ids"] == want.token_ids for ch in many["choices"])
        assert many["usage"]["completion_tokens"] == 3 * len(want.token_ids)
        # Chat: logprobs with top alternatives, one entry per output token.
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": tok.decode(LONG)}],
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        }
        got = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
        text = tok.apply_chat_template([{"role": "user", "content": tok.decode(LONG)}])
        ref = reference.generate([text], SamplingParams(max_tokens=5, logprobs=3))[0]
        assert [e["logprob"] for e in got["content"]] == pytest.approx(
            [x.logprob for x in ref.logprobs], abs=1e-5
        )
        assert all(len(e["top_logprobs"]) == 3 for e in got["content"])
    assert_no_leaks(workers)


@pytest.fixture(scope="module")
def conversation_workers(tiny_path, cache_dir):
    """One prefill and two decode worker processes (fresh caches)."""
    from hybrid_pd.launcher.local import start_worker

    args = ["--model", str(tiny_path), "--kv-memory", "16MiB", "--threads", "1"]
    env = {"HYBRID_PD_CACHE": str(cache_dir)}
    procs = []
    try:
        for role in ("prefill", "decode", "decode"):
            procs.append(start_worker(role, *args, env=env, timeout=60))
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("kv_routing", ["prefix", "load"])
def test_a_follow_up_turn_goes_where_its_prefix_is_and_pulls_only_new_blocks(
    conversation_workers, reference, tiny_path, caplog, kv_routing
):
    """Turn 1 of a chat runs on decode worker F (both idle: the first by address). A long
    stream then busies F. Turn 2 (turn 1's prompt and answer, then new tokens; F holds more
    than half of it): KV-aware routing still sends it to F, whose prefix cache holds turn 1,
    so decode pulls only the new blocks; routing by load sends it to the idle worker, which
    pulls them all. Either way the answers equal one engine's."""
    import concurrent.futures
    import logging

    from hybrid_pd.proxy.worker_client import WorkerClient
    from tests.proxy.test_access_log import ACCESS, wait_for

    caplog.set_level(logging.INFO, logger=ACCESS)
    procs = conversation_workers
    handle = make_proxy(
        tiny_path,
        prefill_addresses=(procs[0].address,),
        decode_addresses=(procs[1].address, procs[2].address),
        kv_routing=kv_routing,
    )
    seed = 0 if kv_routing == "prefix" else 1
    turn1 = [(37 * i + 11 + seed) % 250 + 3 for i in range(120)]
    busy = [(13 * i + 7 + seed) % 250 + 3 for i in range(40)]
    greedy = {"model": "tiny", "temperature": 0, "return_token_ids": True}

    def complete(c, prompt, max_tokens=8):
        r = c.post("/v1/completions", json={**greedy, "prompt": prompt, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        body = r.json()
        line = wait_for(caplog, lambda a: a["id"] == body["id"])  # written once it ended
        return body["choices"][0]["token_ids"], line["decode"]

    def held(address):
        w = WorkerClient(address, timeout_s=10)
        try:
            return w.stats()["decode_connector"]["held_blocks"]
        finally:
            w.close()

    try:
        with httpx.Client(base_url=handle.url, timeout=60) as c:
            answer, first = complete(c, turn1)
            want = reference.generate([turn1], SamplingParams(max_tokens=8))[0].token_ids
            assert answer == want and first == min(procs[1].address, procs[2].address)
            other = ({procs[1].address, procs[2].address} - {first}).pop()
            turn2 = turn1 + answer + [(5 * i + 1 + seed) % 250 + 3 for i in range(20)]
            want2 = reference.generate([turn2], SamplingParams(max_tokens=8))[0].token_ids
            with (
                concurrent.futures.ThreadPoolExecutor(1) as ex,
                c.stream(
                    "POST",
                    "/v1/completions",
                    json={**greedy, "prompt": busy, "max_tokens": 400, "stream": True},
                ) as s,
            ):
                lines = s.iter_lines()
                seen = 0
                for ln in lines:  # past the prefill's first token: decoding on F now
                    seen += ln.startswith("data: {")
                    if seen >= 3:
                        break
                before = {a: held(a) for a in (first, other)}
                answer2, where = ex.submit(complete, c, turn2).result(60)
                for _ in lines:  # let the long stream end on its own
                    pass
            assert answer2 == want2
            after = {a: held(a) for a in (first, other)}
            if kv_routing == "prefix":
                assert where == first
                assert after[first] > before[first]
            else:
                assert where == other and after[other] == before[other]
    finally:
        handle.stop()
        handle.pool.close()
    assert_no_leaks(procs)
