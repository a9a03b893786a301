"""A constrained stream whose decode worker dies migrates: the proxy resends prompt + the
tokens streamed so far, the new decode worker replays them into a fresh matcher and goes
on (a seeded sampled stream's generator skips the draws made elsewhere); the client's
stream is the single engine's output, valid under the schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from hybrid_pd.api.constraint import Constraint
from hybrid_pd.engine.sampling import SamplingParams
from tests.proxy.conftest import assert_no_leaks, make_proxy
from tests.proxy.test_failures import metric
from tests.proxy.test_resilience import (  # noqa: F401
    fleet,
    prompt,
    stream_with_a_decode_worker_killed,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A long string field: the output runs hundreds of tokens, so the kill lands mid-stream.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "story": {"type": "string", "minLength": 200, "maxLength": 240},
    },
    "required": ["id", "story"],
    "additionalProperties": False,
}
MAX_TOKENS = 2000


def test_constrained_stream_survives_its_decode_worker(fleet, tiny_path, reference):  # noqa: F811
    pre, dec_a, dec_b = fleet.add_all(("prefill",), ("decode",), ("decode",))
    proxy = make_proxy(
        tiny_path,
        prefill_addresses=(pre.address,),
        decode_addresses=(dec_a.address, dec_b.address),
    )
    prompts = [prompt(300 + i, 48) for i in range(3)]
    # sampled with a seed, (temperature, seed) per prompt, so that every migrated stream is
    # (greedy replays are covered by the engine's tests and the unconstrained kill tests)
    draws = [(0.9, 5), (0.6, 6), (1.0, 7)]
    con = Constraint.json_schema(SCHEMA)
    want = [
        reference.generate([p], SamplingParams(MAX_TOKENS, t, seed=seed, constraint=con))[0]
        for p, (t, seed) in zip(prompts, draws, strict=True)
    ]
    assert all(w.finish_reason == "stop" and len(w.token_ids) > 200 for w in want)
    by_address = {dec_a.address: dec_a, dec_b.address: dec_b}

    def body(p, temperature, seed):
        return {
            "model": "tiny",
            "prompt": p,
            "max_tokens": MAX_TOKENS,
            "temperature": temperature,
            "seed": seed,
            "return_token_ids": True,
            "guided_json": SCHEMA,
        }

    try:
        bodies = [body(p, *d) for p, d in zip(prompts, draws, strict=True)]
        results, victim = stream_with_a_decode_worker_killed(proxy, by_address, bodies)
        assert [e for _, e in results if e] == []
        assert [ids for ids, _ in results] == [w.token_ids for w in want]
        for w in want:
            jsonschema.validate(json.loads(w.text), SCHEMA)
        text = httpx.get(proxy.url + "/metrics").text
        assert metric(text, 'hybrid_pd_proxy_failures_total{kind="migrated"}') >= 1
    finally:
        proxy.stop()
    survivor = dec_b if victim is dec_a else dec_a
    assert_no_leaks([pre, survivor])
