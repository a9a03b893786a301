"""tool_choice "auto": Hermes-format tool calls parsed out of the model's text, whole and
streamed in any split, and the reply's shape through the proxy."""

from __future__ import annotations

import json
import random

import pytest

from hybrid_pd.proxy.hermes import HermesStream, parse_calls

CALL_A = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
)
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>'
BAD = "<tool_call>{not json}</tool_call>"
CASES = [
    ("Just text, no call.", "Just text, no call.", []),
    ("Let me check. " + CALL_A, "Let me check. ", ["get_weather"]),
    (CALL_A + "\n" + CALL_B, None, ["get_weather", "get_time"]),
    ("a < b <tool_ca", "a < b <tool_ca", []),
    ("x" + BAD, "x" + BAD, []),
    (BAD + CALL_A, BAD, ["get_weather"]),
    ('<tool_call>{"name": "cut", "arguments": {}}', None, ["cut"]),  # max_tokens cut the close
]  # fmt: skip


@pytest.mark.parametrize("text, content, names", CASES)
def test_parse_calls(text, content, names):
    got_content, calls = parse_calls(text)
    assert [c["function"]["name"] for c in calls] == names
    if names:
        assert got_content == content
        for c in calls:
            assert c["type"] == "function" and c["id"].startswith("call_")
            json.loads(c["function"]["arguments"])
    else:
        assert got_content == text


@pytest.mark.parametrize("text, content, names", CASES)
def test_stream_in_any_split_gives_the_same(text, content, names):
    rng = random.Random(len(text))
    for _ in range(30):  # bounded: random cut points
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        s = HermesStream()
        sent = "".join(s.push(p) for p in pieces)
        rest, calls = s.finish()
        assert [c["function"]["name"] for c in calls] == names
        streamed = sent + rest
        if names:
            assert streamed == (content or "")
            assert CALL_A not in sent  # a call's text is never sent as content
        else:
            assert streamed == text


def test_auto_without_a_call_is_plain_content(oai, reference):
    """The random model writes no call: the reply is its text, finish_reason as usual."""
    from tests.proxy.test_structured import TIME, WEATHER

    messages = [{"role": "user", "content": "Anything to call?"}]
    tok = reference.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages))
    from hybrid_pd.api.sampling import SamplingParams

    want = reference.generate([prompt], SamplingParams(max_tokens=12))[0]
    r = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, tools=[WEATHER, TIME]
    )
    choice = r.choices[0]
    assert choice.message.content == want.text and not choice.message.tool_calls
    assert choice.finish_reason == ("length" if want.finish_reason == "length" else "stop")
    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0,
            tools=[WEATHER, TIME],
            tool_choice="auto",
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
