"""Overlap through the proxy: the decode leg starts beside the Prefill and pulls computed
blocks while the prompt computes; outputs equal one engine, on every failure path too."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.launcher.local import start_worker
from hybrid_pd.proxy.worker_client import WorkerClient
from tests.proxy.conftest import KV_MEMORY, assert_no_leaks, make_proxy
from tests.proxy.test_failures import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPT = [(7 * i + 3) % 250 for i in range(300)]  # ten prefill steps of 32 tokens


def _worker(role: str, tiny_path, cache_dir, slow: float = 0.0):
    args = ["--model", str(tiny_path), "--kv-memory", KV_MEMORY, "--threads", "1"]
    env = {"HYBRID_PD_CACHE": str(cache_dir)}
    if role == "prefill":
        args += ["--max-num-batched-tokens", "32"]
        env["HYBRID_PD_INJECT_FAULT"] = f"slow_prefill:{slow}"
    return start_worker(role, *args, env=env, timeout=60)


@pytest.fixture(scope="module")
def overlap(tiny_path, cache_dir):
    """A prefill worker (slowed steps), a decode worker, and a proxy that overlaps."""
    prefill = _worker("prefill", tiny_path, cache_dir, slow=0.05)
    decode = _worker("decode", tiny_path, cache_dir)
    handle = make_proxy(
        tiny_path,
        prefill_addresses=(prefill.address,),
        decode_addresses=(decode.address,),
        overlap_transfer=True,
    )
    yield handle, prefill, decode
    handle.stop()
    handle.pool.close()
    for w in (prefill, decode):
        w.stop()


def _body(prompt=PROMPT, **extra):
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def _in_background(url: str, prompt: list[int]):
    """POST one completion from a thread: (the thread, where its response will be)."""
    result: dict = {}

    def run():
        with httpx.Client(base_url=url, timeout=120) as c:
            result["r"] = c.post("/v1/completions", json=_body(prompt))

    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_overlapped_requests_equal_one_engine_and_stage_blocks(overlap, reference):
    handle, prefill, decode = overlap
    want = reference.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert len(set(want.token_ids)) >= 4, "reference output does not vary"
    with httpx.Client(base_url=handle.url, timeout=60) as c:
        r = c.post("/v1/completions", json=_body())
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
        with c.stream("POST", "/v1/completions", json=_body(stream=True)) as s:
            assert s.status_code == 200
            chunks = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
        streamed = [t for ln in chunks for t in json.loads(ln[6:])["choices"][0]["token_ids"]]
        assert streamed == want.token_ids
        text = c.get("/metrics").text
    assert metric(text, 'hybrid_pd_proxy_routes_total{route="disaggregated"}') == 2
    assert metric(text, 'hybrid_pd_proxy_kv_transfers_total{result="pulled"}') == 2
    stats = WorkerClient(decode.address, timeout_s=5).stats()["decode_connector"]
    assert stats["staged_loads"] == 2 and stats["staged_pulls"] >= 2
    assert 0 < stats["staged_bytes"] < stats["bytes"]
    assert_no_leaks([prefill, decode])


def test_a_first_token_that_ends_the_request_drops_the_staged_leg(overlap, reference):
    handle, prefill, decode = overlap
    first = reference.generate([PROMPT], SamplingParams(max_tokens=1))[0].token_ids[0]
    with httpx.Client(base_url=handle.url, timeout=60) as c:
        r = c.post("/v1/completions", json=_body(stop_token_ids=[first], ignore_eos=False))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [first] and choice["finish_reason"] == "stop"
    assert_no_leaks([prefill, decode])


def test_a_prefill_that_dies_mid_prompt_loses_nothing(tiny_path, cache_dir, overlap, reference):
    """The prefill worker dies while the decode leg follows it: the staged leg is dropped
    and the request runs on the decode worker (no prefill worker left), greedy-equal."""
    _, _, decode = overlap
    doomed = _worker("prefill", tiny_path, cache_dir, slow=0.3)
    handle = make_proxy(
        tiny_path,
        prefill_addresses=(doomed.address,),
        decode_addresses=(decode.address,),
        overlap_transfer=True,
    )
    client = WorkerClient(decode.address, timeout_s=5)
    before = client.stats()["decode_connector"]
    prompt = PROMPT[::-1]  # not in the decode worker's prefix cache: its blocks are pulled
    want = reference.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    t, result = _in_background(handle.url, prompt)
    try:
        deadline = time.monotonic() + 60
        while client.stats()["decode_connector"]["staged_pulls"] == before["staged_pulls"]:
            assert time.monotonic() < deadline, "the decode leg never staged a pull"
            time.sleep(0.05)
        doomed.proc.kill()  # mid-prompt: blocks staged, the prefill not done
        t.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
        after = client.stats()["decode_connector"]
        assert after["staged_loads"] == before["staged_loads"] + 1
        text = httpx.get(f"{handle.url}/metrics").text
        assert metric(text, 'hybrid_pd_proxy_routes_total{route="fallback"}') == 1
        assert_no_leaks([decode])
    finally:
        handle.stop()
        handle.pool.close()
        doomed.stop()


def test_a_decode_worker_lost_during_staging_hands_over_to_another(tiny_path, cache_dir, reference):
    """The decode worker following the prefill dies before the prefill ends: an ordinary
    decode leg on the other decode worker takes the prefill's kept KV; greedy-equal, and
    the prefill worker keeps nothing."""
    prefill = _worker("prefill", tiny_path, cache_dir, slow=0.3)  # ten steps: 3 s or more
    decodes = [_worker("decode", tiny_path, cache_dir) for _ in range(2)]
    handle = make_proxy(
        tiny_path,
        prefill_addresses=(prefill.address,),
        decode_addresses=tuple(w.address for w in decodes),
        overlap_transfer=True,
    )
    clients = [WorkerClient(w.address, timeout_s=5) for w in decodes]
    prompt = PROMPT[1::2] + PROMPT[::2]
    want = reference.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    t, result = _in_background(handle.url, prompt)
    try:
        deadline = time.monotonic() + 60
        while True:
            staged = [c.stats()["decode_connector"]["staged_pulls"] for c in clients]
            if any(staged):
                break
            assert time.monotonic() < deadline, "no decode worker staged a pull"
            time.sleep(0.02)
        doomed = staged.index(max(staged))
        decodes[doomed].proc.kill()
        t.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
        text = httpx.get(f"{handle.url}/metrics").text
        assert metric(text, 'hybrid_pd_proxy_failures_total{kind="staged_fallback"}') == 1
        survivor = clients[1 - doomed].stats()["decode_connector"]
        assert survivor["pulls"] == 1 and survivor["staged_loads"] == 0
        assert_no_leaks([prefill, decodes[1 - doomed]])
    finally:
        handle.stop()
        handle.pool.close()
        for w in (prefill, *decodes):
            w.stop()


def test_a_constrained_request_overlapped_equals_one_engine(overlap, reference):
    """The staged decode leg starts without the first token: the load brings it, the
    decode worker's matcher replays it, and the output is the single engine's."""
    from hybrid_pd.api.constraint import Constraint

    handle, prefill, decode = overlap
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=120, constraint=Constraint.json_schema(schema))
    want = reference.generate([PROMPT], params)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) > 5
    before = WorkerClient(decode.address, timeout_s=5).stats()["decode_connector"]
    body = _body(max_tokens=120, ignore_eos=False, guided_json=schema)
    rescues = [
        f'hybrid_pd_proxy_failures_total{{kind="{k}"}}' for k in ("migrated", "staged_fallback")
    ]
    with httpx.Client(base_url=handle.url, timeout=60) as c:
        before_text = c.get("/metrics").text
        r = c.post("/v1/completions", json=body)
        after_text = c.get("/metrics").text
    # served by the staged leg itself, not rescued by a fallback leg or a migration
    assert [metric(after_text, k) for k in rescues] == [metric(before_text, k) for k in rescues]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["finish_reason"] == "stop"
    after = WorkerClient(decode.address, timeout_s=5).stats()["decode_connector"]
    assert after["staged_loads"] == before["staged_loads"] + 1
    assert_no_leaks([prefill, decode])
