"""The official openai client against the proxy: greedy outputs equal one in-process engine."""

from __future__ import annotations

import pytest

from hybrid_pd.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

N = 12


def expected(reference, prompt, n=N, **kw):
    """(token ids, text, finish reason) of the in-process engine, greedy."""
    out = reference.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, **kw))[0]
    return out.token_ids, out.text, out.finish_reason


def test_completion_text_prompt(oai, reference):
    prompt = "The quick brown fox"
    ids, text, reason = expected(reference, prompt)
    r = oai.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.token_ids == ids
    assert choice.text == text
    assert choice.finish_reason == reason
    assert r.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + len(ids)
    assert r.object == "text_completion" and r.model == "tiny"


def test_completion_token_ids_prompt(oai, reference):
    prompt = [5, 77, 140, 9, 33, 250, 18]
    ids, text, _ = expected(reference, prompt)
    r = oai.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=N,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].token_ids == ids
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens == len(prompt)


def test_completion_stream(oai, reference):
    prompt = "Streaming, one token at a time"
    ids, text, reason = expected(reference, prompt, n=20)
    chunks = list(
        oai.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    got_ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]
    assert got_ids == ids
    assert "".join(ch.text for c in chunks for ch in c.choices) == text
    reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert reasons == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert len(chunks) > 3  # it really streamed


def test_chat_and_chat_stream(oai, reference):
    messages = [{"role": "user", "content": "Say something random."}]
    prompt = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages))
    ids, text, reason = expected(reference, prompt, n=10)
    r = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].token_ids == ids
    assert r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    assert r.object == "chat.completion"

    stream = oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_stop_string(oai, reference):
    prompt = "The quick brown fox"
    _, full, _ = expected(reference, prompt, n=N)
    # A stop string the greedy output contains, past its start: a printable ASCII character.
    stop = next(c for c in full[2:] if c.isascii() and c.isprintable())
    _, text, _ = expected(reference, prompt, n=N, stop=(stop,))
    assert text == full[: full.find(stop)]
    r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0, stop=stop)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "stop"
    s = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=N, temperature=0, stop=[stop], stream=True
    )
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_repeatable(oai):
    kw = dict(model="tiny", prompt="seed", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    a = oai.completions.create(**kw, extra_body={"top_k": 50, "return_token_ids": True})
    b = oai.completions.create(**kw, extra_body={"top_k": 50, "return_token_ids": True})
    assert a.choices[0].token_ids == b.choices[0].token_ids
    assert len(a.choices[0].token_ids) >= 1


def test_concurrent_requests(oai, reference):
    """Requests in flight together (spread over both workers) each get their own output."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[3 + i, 40 + 7 * i, 90, 17 * i % 250, 5] for i in range(6)]
    want = [expected(reference, p, n=8)[0] for p in prompts]

    def ask(i: int) -> list[int]:
        r = oai.completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=8,
            temperature=0,
            stream=i % 2 == 0,
            extra_body={"return_token_ids": True},
        )
        if i % 2:
            return r.choices[0].token_ids
        return [t for c in r for t in c.choices[0].token_ids]

    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(ask, range(6)))
    assert got == want
