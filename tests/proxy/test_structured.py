"""Structured output and forced tool calls through the proxy, with real worker processes:
prefill on one, KV over UCX, decode on the other; the constrained output equals one
in-process engine's under the same constraint (greedy), validates against its schema, and
bad constraints are answered 400 (by the proxy, or by a worker over gRPC)."""

from __future__ import annotations

import json
import random
import re

import grpc
import httpx
import jsonschema
import pytest

from hybrid_pd.api.constraint import Constraint
from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.api.wire import sampling_to_pb
from hybrid_pd.proxy.worker_client import WorkerClient
from tests.proxy.conftest import assert_no_leaks, make_proxy
from tests.proxy.test_failures import metric

pytestmark = pytest.mark.timeout(180)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
        "climate": {"enum": ["dry", "wet", "cold"]},
    },
    "required": ["city", "population", "coastal", "climate"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MAX_TOKENS = 200
ROUTE_PD = 'hybrid_pd_proxy_routes_total{route="disaggregated"}'
# Long enough (>= the proxy's min_prefill_tokens) that the request goes through P/D.
USER = "Describe a city in JSON, please; any city will do, as long as it is well formed. " * 2


@pytest.fixture(scope="module")
def pd_proxy(tiny_path, workers):
    handle = make_proxy(
        tiny_path,
        prefill_addresses=(workers[0].address,),
        decode_addresses=(workers[1].address,),
    )
    yield handle
    handle.stop()
    handle.pool.close()


@pytest.fixture(scope="module")
def client(pd_proxy):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=pd_proxy.base_url, api_key="x", timeout=60, max_retries=0)
    yield c
    c.close()


def chat_prompt(reference, content: str = USER) -> list[int]:
    tok = reference.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]))


def one_engine(reference, prompt: list[int], constraint: Constraint, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint, **kw)
    return reference.generate([prompt], params)[0]


def test_json_schema_pd_equals_one_engine(client, pd_proxy, reference, workers):
    """response_format json_schema, whole and streamed, through P/D: the single engine's
    tokens; the text parses and validates."""
    want = one_engine(reference, chat_prompt(reference), Constraint.json_schema(SCHEMA))
    assert want.finish_reason == "stop"
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": USER}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=fmt,
        extra_body={"return_token_ids": True},
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.token_ids == want.token_ids
    assert choice.message.content == want.text
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    routes = httpx.get(pd_proxy.url + "/metrics").text
    assert metric(routes, 'hybrid_pd_proxy_routes_total{route="disaggregated"}') >= 2
    # each stream finished on its decode leg: no failed leg was rescued by a migration
    assert metric(routes, 'hybrid_pd_proxy_failures_total{kind="migrated"}') == 0
    assert_no_leaks(workers)


@pytest.mark.parametrize("constrained", [True, False])
def test_seeded_sampling_pd_equals_one_engine(client, pd_proxy, reference, constrained):
    """Sampled with a seed through P/D (the prefill worker draws the first token, the decode
    worker's generator skips that draw): the single engine's tokens, with and without the
    schema, for several seeds."""
    before = metric(httpx.get(pd_proxy.url + "/metrics").text, ROUTE_PD)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    constraint = Constraint.json_schema(SCHEMA) if constrained else None
    max_tokens = MAX_TOKENS if constrained else 40
    seeds = [0, 1, 2]
    for seed in seeds:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.9, seed=seed, constraint=constraint
        )
        want = reference.generate([chat_prompt(reference)], params)[0]
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": USER}],
            max_tokens=max_tokens,
            temperature=0.9,
            seed=seed,
            extra_body={"return_token_ids": True},
            **({"response_format": fmt} if constrained else {}),
        )
        assert r.choices[0].token_ids == want.token_ids, seed
        if constrained:
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    after = metric(httpx.get(pd_proxy.url + "/metrics").text, ROUTE_PD)
    assert after - before == len(seeds)


def test_vllm_fields_and_regex_choice(client, reference):
    """structured_outputs / guided_* on completions and chat: the single engine's text."""
    prompt = "Pick a code for the next shipment, in the usual format, thanks a lot: "
    ids = reference.tokenizer.encode(prompt)
    code, mail, names = r"[A-Z]{3}-[0-9]{2,4}", r"[a-z]+@[a-z]+\.org", ["alpha", "beta", "gamma"]
    cases = [
        ({"structured_outputs": {"regex": code}}, Constraint("regex", code)),
        ({"guided_regex": mail}, Constraint("regex", mail)),
        ({"guided_choice": names}, Constraint.choice(names)),
        # one token: the prefill worker's first token ends the request
        ({"guided_choice": ["x", "y"]}, Constraint.choice(["x", "y"])),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA))),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ]  # fmt: skip
    for extra, constraint in cases:
        want = one_engine(reference, ids, constraint)
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        assert r.choices[0].text == want.text, extra
        assert r.choices[0].finish_reason == want.finish_reason
    # sampled and seeded: valid every time, and not always the same
    seen = set()
    for seed in range(6):
        r = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2,4}"},
        )
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", r.choices[0].text)
        seen.add(r.choices[0].text)
    assert len(seen) > 1


def test_named_tool_call(client, reference):
    """tool_choice names a function: its arguments are forced to its parameters' schema and
    come back as tool_calls (finish_reason "tool_calls"), streamed as argument deltas."""
    messages = [{"role": "user", "content": USER.replace("JSON", "weather")}]
    prompt = chat_prompt(reference, messages[0]["content"])
    params = WEATHER["function"]["parameters"]
    want = one_engine(reference, prompt, Constraint.json_schema(params))
    kw = dict(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert call.function.arguments == want.text
    jsonschema.validate(json.loads(call.function.arguments), params)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == want.text
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == ["tool_calls"]


def test_required_tool_calls(client):
    """tool_choice "required": one or more calls of the declared tools, each one's
    arguments valid for its function; streamed as whole calls at the end."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    names = set()
    for seed in range(4):
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": f"Call a tool ({seed})."}],
            max_tokens=400,
            temperature=1.0,
            seed=seed,
            tools=[WEATHER, TIME],
            tool_choice="required",
        )
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            names.add(call.function.name)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [c.function.name for c in calls] == [
            c.function.name for c in choice.message.tool_calls
        ]
        assert [c.function.arguments for c in calls] == [
            c.function.arguments for c in choice.message.tool_calls
        ]
    assert names  # (which tools the random model picks is its business)


def _fmt(spec: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


_NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}
_BAD_PARAMS = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": 3}}}
BAD_BODIES = [
    (_fmt({"name": "x", "schema": {"type": "nope"}}), "response_format"),
    (_fmt({"name": "x"}), "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    (_fmt({"schema": {"$ref": "#/nope"}}), "response_format"),
    (_fmt({"schema": {"type": "array", "uniqueItems": True}}), "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": [1, 2]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "x" * 70_000}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "auto", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": _NAMED_NOPE}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [_BAD_PARAMS], "tool_choice": "required"}, "tool_choice"),
]  # fmt: skip


def test_bad_constraints_are_400(pd_proxy, workers):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    with httpx.Client(base_url=pd_proxy.url, timeout=60) as c:
        for extra, param in BAD_BODIES:
            r = c.post("/v1/chat/completions", json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (extra, err)
            assert err["message"]
        # a bounded fuzz loop: mutated schemas get 200 or 400, never anything else
        rng = random.Random(11)
        text = json.dumps(SCHEMA)
        statuses = set()
        for _ in range(40):
            chars = list(text)
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(chars))
                chars[i : i + 1] = rng.choice(['"', "{", "}", "[", "]", ":", ",", "x", "", "1"])
            body = {**base, "guided_json": "".join(chars), "max_tokens": 20, "temperature": 0}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code in (200, 400), r.text
            statuses.add(r.status_code)
        assert statuses == {200, 400}
        ok = c.post("/v1/chat/completions", json={**base, "guided_choice": ["yes", "no"]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in (
            "yes",
            "no",
        )
    assert_no_leaks(workers)


def test_worker_refuses_a_constraint_it_cannot_compile(workers):
    """Past the proxy (a client of the gRPC API): INVALID_ARGUMENT, and the worker goes on."""
    client = WorkerClient(workers[0].address, timeout_s=30)
    try:
        bad = sampling_to_pb(SamplingParams(max_tokens=5))
        bad.constraint.kind, bad.constraint.value = "regex", "(unclosed"
        with pytest.raises(grpc.RpcError) as e:
            client.generate("bad-1", [1, 2, 3], bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalid regex" in e.value.details()
        bad.constraint.kind = "lark"
        with pytest.raises(grpc.RpcError) as e:
            client.prefill("bad-2", [1, 2, 3], bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        good = sampling_to_pb(SamplingParams(max_tokens=5, constraint=Constraint.choice(["ok"])))
        out = client.generate("good-1", [1, 2, 3], good)
        assert out.finish_reason == "stop"
    finally:
        client.close()
    assert_no_leaks(workers)
