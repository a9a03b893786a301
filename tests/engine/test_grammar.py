"""Constrained decoding in the engine (the built-in tiny model, byte-level tokenizer): every
output of a random-weight model under a JSON schema parses and validates, greedy and
sampled, batched with unconstrained requests; a continuation from replayed tokens (the
decode side of a hand-off, a migrated stream) equals the single run; bad constraints are
refused with ValueError."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from hybrid_pd.api.constraint import MAX_CONSTRAINT_CHARS, Constraint
from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.engine.tiny import ensure_tiny

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "kind", "tags"],
    "additionalProperties": False,
}
# Long enough for any output the schema allows on a byte-level tokenizer (a character may
# take 4 tokens).
MAX_TOKENS = 260


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ensure_tiny(tmp_path_factory.mktemp("cache")))


def make_engine(loaded, **kw) -> Engine:
    model, config, tok = loaded
    return Engine(model, config, EngineConfig(max_num_seqs=64, **kw), tok)


def run_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    rids = [engine.add_request(p, params) for p, params in requests]
    final = {}
    for _ in range(100_000):  # bounded: a request ends by max_tokens at the latest
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[r] for r in rids]


def test_every_output_validates_greedy_and_sampled(loaded):
    engine = make_engine(loaded)
    tok = engine.tokenizer
    con = Constraint.json_schema(SCHEMA)
    rng = random.Random(0)
    requests = []
    for i in range(192):  # sampled, one seed each
        params = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=1000 + i, constraint=con
        )
        requests.append((tok.encode(f"person {i}: "), params))
    for _ in range(48):  # greedy, a prompt each
        prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 40))]
        requests.append((prompt, SamplingParams(max_tokens=MAX_TOKENS, constraint=con)))
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [([rng.randrange(256) for _ in range(12)], free) for _ in range(4)]
    outs = run_all(engine, requests + plain)
    texts = []
    for out in outs[: len(requests)]:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        texts.append(out.text)
    # the outputs really vary (a test that only ever saw one value would prove little)
    assert len(set(texts)) > len(texts) * 3 // 4
    assert len({json.loads(t)["age"] for t in texts}) > 4
    assert any(json.loads(t)["tags"] for t in texts)
    # unconstrained requests in the same batches are untouched by the masks
    for (prompt, params), out in zip(plain, outs[len(requests) :], strict=True):
        alone = make_engine(loaded).generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
    assert engine.grammars.compiled == 1  # one compile for every request of the schema
    engine.kv.check_integrity()


@pytest.mark.parametrize("constrained", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replayed_tokens_continue_exactly(loaded, temperature, constrained):
    """A request given the first k tokens of a run (a decode worker after a hand-off, or a
    migration target) continues from there with the run's own tokens, greedy and sampled
    (its seeded generator skips the k draws it did not make), with and without the
    constraint; constrained, the output validates."""
    con = Constraint.json_schema(SCHEMA) if constrained else None
    max_tokens = MAX_TOKENS if constrained else 40
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7, constraint=con)
    prompt = loaded[2].encode("record: ")
    whole = make_engine(loaded).generate([prompt], params)[0]
    assert whole.finish_reason == ("stop" if constrained else "length")
    cuts = [1, 5, len(whole.token_ids) // 2]
    for k in cuts:
        engine = make_engine(loaded)
        rid = engine.add_request(prompt, params, output_ids=whole.token_ids[:k])
        final = None
        for _ in range(10_000):
            if not engine.has_unfinished():
                break
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    final = out
        assert final is not None and final.finish_reason == whole.finish_reason
        assert final.token_ids == whole.token_ids, k
        if constrained:
            jsonschema.validate(json.loads(final.text), SCHEMA)


def test_replay_that_breaks_the_constraint_is_refused(loaded):
    engine = make_engine(loaded)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=50, constraint=Constraint.json_schema(SCHEMA))
    with pytest.raises(ValueError, match="do not match the constraint"):
        engine.add_request(tok.encode("x"), params, output_ids=tok.encode("[1"))
    assert not engine.has_unfinished()


def test_regex_choice_and_json_object(loaded):
    engine = make_engine(loaded)
    tok = engine.tokenizer
    cases = [
        (Constraint("regex", r"[a-z]{2,6}-[0-9]{1,3}"), r"^[a-z]{2,6}-[0-9]{1,3}$"),
        (Constraint.choice(["red", "green", "blue"]), r"^(red|green|blue)$"),
    ]
    import re

    for con, pattern in cases:
        seen = set()
        for seed in range(12):
            params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, constraint=con)
            out = engine.generate([tok.encode(f"{seed}")], params)[0]
            assert out.finish_reason == "stop" and re.match(pattern, out.text), out.text
            seen.add(out.text)
        assert len(seen) > 1
    # any JSON object: what is written is always a prefix of one
    con = Constraint("json_object")
    out = engine.generate([tok.encode("{")], SamplingParams(max_tokens=8, constraint=con))[0]
    assert out.text.startswith("{")


BAD = [
    Constraint("json_schema", '{"type": "nope"}'),
    Constraint("json_schema", '{"$ref": "#/definitions/missing"}'),
    Constraint("json_schema", '{"type": "string", "pattern": "[a-"}'),
    Constraint("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'),
    Constraint("regex", "(unclosed"),
    Constraint("regex", "a{5,2}"),
]


@pytest.mark.parametrize("con", BAD, ids=lambda c: c.value[:24])
def test_bad_constraints_are_refused(loaded, con):
    engine = make_engine(loaded)
    with pytest.raises(ValueError, match="invalid"):
        con.check()
    with pytest.raises(ValueError, match="invalid"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, constraint=con))
    assert not engine.has_unfinished()


def test_shape_checks():
    with pytest.raises(ValueError, match="too large"):
        Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))
    with pytest.raises(ValueError, match="not valid JSON"):
        Constraint("json_schema", "{")
    with pytest.raises(ValueError, match="kind"):
        Constraint("lark", "start: x")
    with pytest.raises(ValueError, match="list of strings"):
        Constraint("choice", "[1, 2]")


def test_fuzzed_schemas_never_crash(loaded):
    """Random mutations of a schema: each compiles or raises ValueError, nothing else, and
    a compiled one constrains a short run (bounded count)."""
    engine = make_engine(loaded)
    rng = random.Random(3)
    text = json.dumps(SCHEMA)
    alphabet = '{}[]":,0123456789abcdefghijklmnopqrstuvwxyz-$#/\\'
    refused = compiled = 0
    for _ in range(120):
        chars = list(text)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(chars))
            op = rng.randrange(3)
            if op == 0:
                del chars[i]
            elif op == 1:
                chars.insert(i, rng.choice(alphabet))
            else:
                chars[i] = rng.choice(alphabet)
        try:
            con = Constraint("json_schema", "".join(chars))
            engine.grammars.compile(con)
        except ValueError:
            refused += 1
            continue
        compiled += 1
        if compiled <= 5:
            out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=30, constraint=con))[0]
            assert out.finish_reason in ("stop", "length")
    assert refused and compiled


def test_an_engine_without_a_tokenizer_refuses_constraints(loaded):
    model, config, _ = loaded
    engine = Engine(model, config, EngineConfig())
    params = SamplingParams(max_tokens=5, constraint=Constraint("json_object"))
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished()
