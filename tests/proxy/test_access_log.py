"""The proxy's access log (`hybrid_pd.access`): one line per request, with the values the
request really had, written when the response (or the stream) ends; 499 for a client that
left first."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from hybrid_pd.api.tokenizer import Tokenizer
from hybrid_pd.proxy.access_log import format_line

from .conftest import assert_no_leaks

ACCESS = "hybrid_pd.access"


def parse(line: str) -> dict[str, str]:
    method, path, *pairs = line.split(" ")
    return {"method": method, "path": path, **dict(p.split("=", 1) for p in pairs)}


def access_lines(caplog, level: int = logging.INFO) -> list[dict[str, str]]:
    return [
        parse(r.getMessage()) for r in caplog.records if r.name == ACCESS and r.levelno == level
    ]


def wait_for(caplog, pred, timeout: float = 10.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        found = [a for a in access_lines(caplog) if pred(a)]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, access_lines(caplog)
        time.sleep(0.05)


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.DEBUG, logger=ACCESS)
    return caplog


def test_completion_and_stream_lines_carry_the_requests_values(access, http, tiny_path):
    prompt = "The access log counts these prompt tokens."
    n_prompt = len(Tokenizer(tiny_path).encode(prompt))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    r = http.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    line = wait_for(access, lambda a: a["id"] == r.json()["id"])
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/completions", "200")
    assert line["route"] == "decode_only"  # no prefill pool behind this proxy
    assert int(line["prompt_tokens"]) == n_prompt == r.json()["usage"]["prompt_tokens"]
    assert int(line["output_tokens"]) == 5
    assert 0 < float(line["ttft_ms"]) <= float(line["total_ms"])
    assert line["client"] == "127.0.0.1"
    assert line["prefill"] == "-" and line["decode"].startswith("127.0.0.1:")

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    line = wait_for(access, lambda a: a["path"] == "/v1/chat/completions")
    assert line["status"] == "200" and line["id"].startswith("chatcmpl-")
    assert 1 <= int(line["output_tokens"]) <= 4


def test_refused_requests_and_probes(access, http):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400
    line = wait_for(access, lambda a: a["status"] == "400")
    assert line["id"] == line["route"] == line["prompt_tokens"] == line["ttft_ms"] == "-"
    assert http.get("/health").status_code == 200
    time.sleep(0.1)
    assert not [a for a in access_lines(access) if a["path"] == "/health"]  # info: quiet
    assert [a for a in access_lines(access, logging.DEBUG) if a["path"] == "/health"]


def test_a_client_that_leaves_is_logged_499(access, proxy, workers):
    body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
    line = wait_for(access, lambda a: a["status"] == "499")
    assert 1 <= int(line["output_tokens"]) < 2000 and line["route"] == "decode_only"
    with httpx.Client(base_url=proxy.url, timeout=0.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=body)
    wait_for(access, lambda a: a["status"] == "499" and a["id"] != line["id"])
    assert_no_leaks(workers, 4.0)


def test_format_line_without_a_first_token():
    class Job:
        rid, route, prompt_ids, produced, arrival, first_token_at = (
            "cmpl-1",
            "",
            [1, 2],
            [],
            0,
            None,
        )

    line = format_line("POST", "/v1/completions", 429, 0.25, Job())
    assert line == (
        "POST /v1/completions status=429 id=cmpl-1 route=- prompt_tokens=2 output_tokens=0 "
        "ttft_ms=- total_ms=250.0 prefill=- decode=- client=-"
    )
    job, other = Job(), Job()
    job.prefill_worker, job.decode_worker = "p:1", "d:1"
    other.prefill_worker, other.decode_worker = "p:1", "d:2"
    line = format_line("POST", "/v1/completions", 200, 0.25, [job, other])
    assert line.endswith(" prefill=p:1 decode=d:1,d:2 client=-")
