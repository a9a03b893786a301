"""Whatever a client sends, the proxy answers 2xx or an OpenAI-shaped 4xx, never a 5xx, and
keeps answering afterwards. The worker behind it is scripted (the subject is the HTTP edge)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.proxy.conftest import make_proxy
from tests.proxy.fakes import FakeWorker

pytestmark = pytest.mark.timeout(600)
EXAMPLES = 700

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream", "stream_options", "n",
    "logprobs", "top_logprobs", "echo", "ignore_eos", "return_token_ids", "tools",
    "tool_choice", "response_format", "logit_bias", "presence_penalty", "user", "tokens",
    "suffix", "best_of", "unknown_field", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice",
)  # fmt: skip

# Integers at and past every wire type's edge, floats with their specials. This process
# flushes subnormal floats (tests/conftest.py), so hypothesis draws none itself: the listed
# ones (subnormal as float64, or zero once float32) are sent as they are.
edge_ints = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1])
tiny_floats = st.sampled_from([5e-324, -5e-324, 1e-310, 2.2250738585072009e-308, 1e-40, 1e-46])
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    edge_ints,
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
    tiny_floats,
)
# Text with control characters and astral code points (lone surrogates are added below).
texts = st.text(st.characters(codec=None, exclude_categories=("Cs",)), max_size=40)
leaves = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(texts, st.sampled_from(FIELDS)), inner, max_size=5),
    ),
    max_leaves=20,
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x", "user|>"]),
             "content": st.one_of(texts, values)},
        ),
        values,
    ),
    max_size=4,
)  # fmt: skip
anything = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("tiny"), values),
        "prompt": st.one_of(texts, st.lists(st.one_of(edge_ints, st.integers(0, 300))), values),
        "messages": messages,
        **{name: values for name in FIELDS[3:]},
    },
)
# Well-typed values, so that many requests pass validation and reach the worker.
sane = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.floats(0, 2, allow_subnormal=False), tiny_floats),
    "top_p": st.one_of(st.floats(0.01, 1), tiny_floats),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 258), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "user": texts,
}
near_valid = st.builds(
    lambda head, extra, odd: {**head, **extra, **odd},
    st.one_of(
        st.fixed_dictionaries(
            {"model": st.just("tiny"), "prompt": st.one_of(
                st.text(min_size=1, max_size=60),
                st.lists(st.integers(0, 258), min_size=1, max_size=40),
            )}
        ),
        st.fixed_dictionaries(
            {"model": st.just("tiny"), "messages": st.lists(st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": texts}
            ), min_size=1, max_size=3)}
        ),
    ),
    st.fixed_dictionaries({}, optional=sane),
    st.one_of(st.just({}), st.dictionaries(st.sampled_from(FIELDS), values, max_size=1)),
)  # fmt: skip
bodies = st.one_of(anything, near_valid)


def _raw(body: object, surrogate: bool) -> bytes:
    text = json.dumps(body)  # NaN / Infinity literals included, as many clients send them
    if surrogate and text.endswith("}") and len(text) > 2:
        text = text[:-1] + ', "user": "\\ud800"}'
    return text.encode()


@pytest.fixture(scope="module")
def fuzz_proxy(tiny_path):
    worker = FakeWorker(generate="ok")
    proxy = make_proxy(tiny_path, decode_addresses=(worker.address,), min_prefill_tokens=10**9)
    yield proxy
    proxy.stop()
    proxy.pool.close()
    worker.stop()


def test_no_body_gets_a_5xx(fuzz_proxy):
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=fuzz_proxy.url, timeout=30) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(body=bodies, endpoint=st.sampled_from(ENDPOINTS), surrogate=st.booleans())
        def check(body, endpoint, surrogate):
            if "messages" in body and "prompt" not in body and endpoint == "/v1/completions":
                endpoint = "/v1/chat/completions"  # let near-valid chat bodies reach chat
            r = client.post(endpoint, content=_raw(body, surrogate))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (endpoint, body, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] is None or isinstance(err["code"], str)
            else:
                r.read()

        check()
        assert client.get("/v1/models").status_code == 200
        metrics = client.get("/metrics").text
    print("statuses:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= EXAMPLES
    # The generator reaches past validation, not only into it.
    assert statuses.get(200, 0) >= 20, statuses
    assert 'failures_total{kind="internal"}' not in metrics
