"""The same constraint and prompt through vLLM's OpenAI server and through our engine give
the same greedy token ids. vLLM runs llguidance as its `guidance` backend with
`disable_any_whitespace` (compact JSON, the grammar our engine compiles); both read the
checkpoint's tokenizer. One small checkpoint, a JSON schema and a regex, a few prompts."""

from __future__ import annotations

import json

import pytest

from hybrid_pd.api.constraint import Constraint
from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.bench.vllm_servers import Server, start_all
from tests.vllm_connector import checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["ab", "cd", "ef"]},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["n", "kind", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,5}-[0-9]{1,3}"
MAX_TOKENS = 80
# vLLM's structured-output settings that make its grammar ours: llguidance, compact JSON
GUIDANCE = {"backend": "guidance", "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from hybrid_pd.engine.engine import Engine, EngineConfig
    from hybrid_pd.engine.loader import load_model

    root = tmp_path_factory.mktemp("structured")
    model = checkpoints.gemma3(root / "ckpt")
    server = Server(
        model,
        root / "vllm.log",
        dtype="float32",
        single_process=True,
        extra_args=("--structured-outputs-config", json.dumps(GUIDANCE)),
    )
    try:
        start_all([server])
        m, config, tok = load_model(model)
        engine = Engine(m, config, EngineConfig(kv_memory_bytes=32 * 2**20), tok)
        yield server, engine
    finally:
        server.stop()


def _prompts(tok) -> list[list[int]]:
    texts = ["a record:", "Write it as JSON, please", "zz"]
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize(
    "field, constraint",
    [
        ({"json": SCHEMA}, Constraint.json_schema(SCHEMA)),
        ({"regex": REGEX}, Constraint("regex", REGEX)),
    ],
    ids=["json_schema", "regex"],
)
def test_same_greedy_tokens_as_vllm(pair, field, constraint):
    server, engine = pair
    served = server.client.get("/v1/models").json()["data"][0]["id"]
    params = SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint)
    eos = set(engine.eos_token_ids)
    for prompt in _prompts(engine.tokenizer):
        ours = engine.generate([prompt], params)[0]
        assert ours.finish_reason == "stop", ours
        body = {
            "model": served,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
            "structured_outputs": field,
        }
        choice = server.complete(body)["choices"][0]
        theirs = list(choice["token_ids"])
        # where the grammar ends (accepts nothing more), vLLM samples the end-of-sequence
        # token it leaves and returns it; ours stops there without it
        if ours.token_ids[-1] not in eos and theirs and theirs[-1] in eos:
            theirs.pop()
        assert choice["finish_reason"] == "stop", choice
        assert theirs == ours.token_ids, (prompt, choice["text"], ours.text)
        assert choice["text"] == ours.text
    if field.get("json"):
        json.loads(ours.text)  # the last one parses
