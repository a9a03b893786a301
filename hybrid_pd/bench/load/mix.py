"""The load of `hybrid-pd bench load`: a seeded mix of requests, sending them with bounded
concurrency, and the accounting of what came of each one.

Every request sent ends completed or failed, with its kind of failure: the HTTP status
("503"), "stream_error" (an error event inside a stream), "stream_incomplete" (the stream
ended without its final chunk), "bad_response" (an answer that does not parse),
"connection_error", "timeout" (the request's own deadline) or "time_limit" (the bench's
overall limit cut it)."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybrid_pd.bench.completions import _ms, _progress


@dataclass(frozen=True)
class LoadRequest:
    index: int
    path: str
    body: dict
    stream: bool


def random_text(rng: random.Random, n: int) -> str:
    """`n` characters of lowercase words: no two requests share a prefix worth caching."""
    words: list[str] = []
    size = 0
    while size < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n]


def make_request(
    model: str,
    tag: str,
    index: int,
    chars: tuple[int, int] = (10, 2000),
    stream: bool | None = None,
) -> LoadRequest:
    """Request `index` of the mix `tag`: the same tag and index give the same request.
    Completion or chat, streaming or not (unless `stream` says), greedy, 1-64 tokens."""
    rng = random.Random(f"{tag}-{index}")
    n = rng.randint(*chars)
    chat = rng.random() < 0.5
    streaming = rng.random() < 0.5 if stream is None else stream
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(1, 64),
        "temperature": 0,
        "stream": streaming,
        "return_token_ids": True,
    }
    text = random_text(rng, n)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if streaming:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return LoadRequest(index, path, body, streaming)


def make_mix(model: str, tag: str, n: int, **kw: Any) -> list[LoadRequest]:
    return [make_request(model, tag, i, **kw) for i in range(n)]


@dataclass
class Outcome:
    index: int
    stream: bool
    start: float
    end: float = 0.0
    ok: bool = False
    kind: str | None = None  # failure kind
    answered: bool = False  # the service said it failed (status or error event)
    ttft: float | None = None
    tokens: int = 0
    text: str = ""
    error: str = ""

    def fail(self, kind: str, error: str, answered: bool = False) -> None:
        self.kind, self.error, self.answered = kind, error[:300], answered


def _piece(choice: dict) -> str:
    """The text of one choice: a completion's, a chat message's or a stream delta's."""
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


async def send(client, req: LoadRequest, timeout_s: float, deadline: float) -> Outcome:
    """One request, never raising for a failure of the service: the outcome says what
    happened. Its deadline is its own timeout or the bench's time limit, whichever is first."""
    import httpx

    t0 = time.monotonic()
    budget = min(timeout_s, deadline - t0)
    out = Outcome(req.index, req.stream, t0)
    try:
        async with asyncio.timeout(max(budget, 0.001)):
            await (_streamed if req.stream else _whole)(client, req, out)
    except TimeoutError:
        kind = "timeout" if budget >= timeout_s else "time_limit"
        out.fail(kind, f"no complete answer within {budget:.1f} s")
    except httpx.TimeoutException as e:
        out.fail("timeout", f"{type(e).__name__}: {e}")
    except httpx.TransportError as e:
        out.fail("connection_error", f"{type(e).__name__}: {e}")
    except (httpx.DecodingError, ValueError, KeyError, TypeError, IndexError) as e:
        out.fail("bad_response", f"{type(e).__name__}: {e}")
    out.end = time.monotonic()
    return out


async def _whole(client, req: LoadRequest, out: Outcome) -> None:
    r = await client.post(req.path, json=req.body)
    if r.status_code != 200:
        out.fail(str(r.status_code), r.text, answered=True)
        return
    body = r.json()
    out.text = _piece(body["choices"][0])
    out.tokens = int(body["usage"]["completion_tokens"])
    out.ok = True


async def _streamed(client, req: LoadRequest, out: Outcome) -> None:
    async with client.stream("POST", req.path, json=req.body) as r:
        if r.status_code != 200:
            await r.aread()
            out.fail(str(r.status_code), r.text, answered=True)
            return
        parts: list[str] = []
        ids = 0
        usage = None
        finished = done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                out.fail("stream_error", json.dumps(obj["error"]), answered=True)
                return
            if obj.get("usage"):
                usage = int(obj["usage"]["completion_tokens"])
            for choice in obj.get("choices") or ():
                piece = _piece(choice)
                n = len(choice.get("token_ids") or ())
                if (piece or n) and out.ttft is None:
                    out.ttft = time.monotonic() - out.start
                parts.append(piece)
                ids += n
                finished = finished or bool(choice.get("finish_reason"))
    if not (done and finished):
        out.fail("stream_incomplete", f"the stream ended early ([DONE] {done}, finish {finished})")
        return
    out.text = "".join(parts)
    out.tokens = usage if usage is not None else ids
    out.ok = True


async def run_requests(
    url: str,
    reqs: list[LoadRequest],
    concurrency: int,
    timeout_s: float,
    deadline: float,
    on_result: Callable[[Outcome, list[Outcome]], None] | None = None,
    desc: str = "",
    progress: bool = False,
) -> tuple[list[Outcome], float]:
    """Send `reqs` with at most `concurrency` in flight; none starts after `deadline`.
    Returns the outcomes (in the order they ended) and the wall time."""
    import httpx

    outcomes: list[Outcome] = []
    pending = iter(reqs)
    bar = _progress(len(reqs), desc, progress)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
    t0 = time.monotonic()

    async def lane(client) -> None:
        for req in pending:
            if time.monotonic() >= deadline:
                return
            out = await send(client, req, timeout_s, deadline)
            outcomes.append(out)
            bar.update()
            if on_result is not None:
                on_result(out, outcomes)

    try:
        async with httpx.AsyncClient(
            base_url=url, timeout=timeout, limits=limits, trust_env=False
        ) as client:
            await asyncio.gather(*(lane(client) for _ in range(concurrency)))
    finally:
        bar.close()
    end = max((o.end for o in outcomes), default=time.monotonic())
    return outcomes, max(end - t0, 1e-9)


def summarize(total: int, outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    """Counts, throughput and latencies of one load of `total` requests. `lost` counts the
    failed requests that got no answer at all (no error status, no error event); requests
    never sent (the time limit came first) are `not_sent`."""
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    tokens = sum(o.tokens for o in ok)
    ttft = [o.ttft for o in ok if o.stream and o.ttft is not None]
    e2e = [o.end - o.start for o in ok]
    return {
        "requests": total,
        "sent": len(outcomes),
        "not_sent": total - len(outcomes),
        "completed": len(ok),
        "failed": len(failed),
        "failed_by_kind": dict(sorted(Counter(str(o.kind) for o in failed).items())),
        "lost": sum(1 for o in failed if not o.answered),
        "streaming": sum(1 for o in outcomes if o.stream),
        "seconds": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft_ms_p50": _ms(ttft, 50),
        "ttft_ms_p99": _ms(ttft, 99),
        "e2e_ms_p50": _ms(e2e, 50),
        "e2e_ms_p99": _ms(e2e, 99),
        "error_samples": sorted({f"{o.kind}: {o.error}"[:200] for o in failed})[:5],
    }


def texts(outcomes: list[Outcome]) -> dict[int, str]:
    """Request index -> text of the completed requests."""
    return {o.index: o.text for o in outcomes if o.ok}


def compare_texts(a: dict[int, str], b: dict[int, str]) -> dict[str, int]:
    common = sorted(set(a) & set(b))
    return {"compared": len(common), "mismatched": sum(1 for i in common if a[i] != b[i])}
