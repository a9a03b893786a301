"""Failures: prefill retry and fallback, decode errors mid-stream, silent workers, and client
disconnects (the request is aborted on the worker). Never a hang."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from hybrid_pd.engine.sampling import SamplingParams
from tests.proxy.conftest import assert_no_leaks, make_proxy
from tests.proxy.fakes import FakeWorker

pytestmark = pytest.mark.timeout(120)

LONG = [(7 * i + 3) % 250 for i in range(48)]  # >= min_prefill_tokens (32)


@pytest.fixture
def fakes():
    made: list[FakeWorker] = []

    def make(**kw) -> FakeWorker:
        made.append(FakeWorker(**kw))
        return made[-1]

    yield make
    for f in made:
        f.stop()


@pytest.fixture
def proxies():
    made = []

    def make(tiny_path, **fields):
        made.append(make_proxy(tiny_path, **fields))
        return made[-1]

    yield make
    for p in made:
        p.stop()
        p.pool.close()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return 0.0


def sse_events(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_prefill_unavailable_twice_falls_back_to_decode(
    tiny_path, workers, reference, fakes, proxies
):
    p1, p2 = fakes(prefill="unavailable"), fakes(prefill="unavailable")
    proxy = proxies(
        tiny_path,
        prefill_addresses=(p1.address, p2.address),
        decode_addresses=(workers[0].address,),
    )
    want = reference.generate([LONG], SamplingParams(max_tokens=6))[0].token_ids
    body = {
        "model": "tiny",
        "prompt": LONG,
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        text = c.get("/metrics").text
    # One try on each prefill worker, then the decode worker ran it all.
    assert [k for k, _ in p1.calls].count("prefill") == 1
    assert [k for k, _ in p2.calls].count("prefill") == 1
    assert metric(text, 'hybrid_pd_proxy_failures_total{kind="prefill_unavailable"}') == 2
    assert metric(text, 'hybrid_pd_proxy_failures_total{kind="prefill_fallback"}') == 1
    assert metric(text, 'hybrid_pd_proxy_routes_total{route="fallback"}') == 1


def test_decode_error_mid_stream_ends_with_error_event(tiny_path, fakes, proxies):
    bad = fakes(generate="error_chunk", tokens=(72, 105))
    proxy = proxies(tiny_path, decode_addresses=(bad.address,))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert "".join(e["choices"][0]["text"] for e in events if "choices" in e) == "Hi"
        assert "fake engine crash" in events[-2]["error"]["message"]
        assert events[-1] == "[DONE]"
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and "fake engine crash" in r.json()["error"]["message"]
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=proxy.base_url, api_key="x", timeout=30, max_retries=0)
    with pytest.raises(openai.APIError, match="fake engine crash"):
        for _ in client.completions.create(model="tiny", prompt="hi", max_tokens=8, stream=True):
            pass
    client.close()


def test_silent_decode_worker_times_out(tiny_path, fakes, proxies):
    silent = fakes(generate="silent", tokens=(72,))
    proxy = proxies(tiny_path, decode_addresses=(silent.address,), stream_idle_timeout_s=1.0)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}
    start = time.monotonic()
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = sse_events(r)
    assert time.monotonic() - start < 10
    assert "sent nothing" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert silent.cancelled.wait(5), "the proxy did not cancel the stream"
    deadline = time.monotonic() + 5
    while not any(k == "abort" for k, _ in silent.calls):
        assert time.monotonic() < deadline, "the proxy sent no Abort"
        time.sleep(0.05)


def test_unavailable_decode_worker_is_retried_once(tiny_path, workers, fakes, proxies):
    down = fakes(generate="unavailable")
    proxy = proxies(tiny_path, decode_addresses=(down.address, workers[0].address))
    body = {"model": "tiny", "prompt": "retry me", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        text = c.get("/metrics").text
    assert [k for k, _ in down.calls].count("generate") == 1
    assert metric(text, 'hybrid_pd_proxy_failures_total{kind="decode_unavailable"}') == 1


def test_client_disconnect_aborts_the_request(proxy, workers):
    body = {
        "model": "tiny",
        "prompt": "long",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    # 2000 tokens take the tiny model many seconds: idle this soon means it was aborted.
    assert_no_leaks(workers, 4.0)
    with httpx.Client(base_url=proxy.url, timeout=0.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=body)
    assert_no_leaks(workers, 4.0)
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        text = c.get("/metrics").text
    assert metric(text, 'hybrid_pd_proxy_failures_total{kind="client_disconnect"}') >= 2
