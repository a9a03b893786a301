"""The OpenAI-compatible HTTP front door: `build_app(config, pool)` -> FastAPI app."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybrid_pd.api.sampling import INT64_MAX, SamplingParams
from hybrid_pd.proxy.access_log import AccessLog
from hybrid_pd.proxy.config import ProxyConfig
from hybrid_pd.proxy.detok import TextStream
from hybrid_pd.proxy.dispatch import Dispatcher, Job, TokenEvent
from hybrid_pd.proxy.errors import ProxyError, bad_request
from hybrid_pd.proxy.metrics import ProxyMetrics, RequestCounter
from hybrid_pd.proxy.model import ServedModel
from hybrid_pd.proxy.protocol import (
    GenerationRequest,
    ModelContext,
    model_not_found,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from hybrid_pd.proxy.responses import Choice, ResponseBuilder, finish_reason, new_id, sse
from hybrid_pd.proxy.routing import WorkerPool

logger = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's "client closed request": the response goes nowhere


class _ClientGone(Exception):
    pass


def build_app(config: ProxyConfig, pool: WorkerPool) -> FastAPI:
    """Blocking: asks the workers what they serve (a proxy whose workers are all down
    still starts, and learns it on the first request that finds one up)."""
    served = ServedModel(config, pool)
    if served.learn() is None:
        logger.warning("no worker described its model yet; asking again on the first request")
    tokenizing = Tokenizing()
    metrics = ProxyMetrics()
    dispatcher = Dispatcher(config, pool, metrics)
    created = int(time.time())

    app = FastAPI(title="hybrid-pd proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config, app.state.pool, app.state.metrics = config, pool, metrics
    app.state.model = served
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(AccessLog)

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, e: ProxyError) -> JSONResponse:
        if e.kind:
            metrics.failure(e.kind)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = ProxyError(e.status_code, str(e.detail), type="invalid_request_error")
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        metrics.failure("internal")
        err = ProxyError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=500)

    def model_card(name: str) -> dict:
        card = {"id": name, "object": "model", "created": created, "owned_by": "hybrid-pd"}
        if served.card is not None:
            card["root"] = served.card.model
            card["max_model_len"] = served.ctx.max_model_len
        return card

    @app.get("/v1/models")
    async def models() -> dict:
        if served.card is None:
            await asyncio.to_thread(served.learn)
        return {"object": "list", "data": [model_card(n) for n in served.names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        if served.card is None:
            await asyncio.to_thread(served.learn)
        if name not in served.names:
            raise model_not_found(name, served.names)
        return model_card(name)

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = await asyncio.to_thread(pool.check_health)
        ok = any(w["healthy"] and "decode" in w["roles"] for w in workers)
        body = {"status": "ok" if ok else "unavailable", "workers": workers}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        await asyncio.to_thread(pool.refresh)
        return Response(metrics.render(pool.snapshot()), media_type=metrics.content_type)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _json(request, tokenizing.run)
        ctx = await served.context()
        ids = await tokenizing.run(parse_tokenize, body, ctx)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await _json(request, tokenizing.run)
        ctx = await served.context()
        return {"prompt": await tokenizing.run(parse_detokenize, body, ctx)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        # Parsing tokenizes: a thread keeps a huge prompt from stalling everyone else.
        body = await _json(request, tokenizing.run)
        ctx = await served.context()
        return await _generate(request, ctx, await tokenizing.run(parse_completion, body, ctx))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json(request, tokenizing.run)
        ctx = await served.context()
        return await _generate(request, ctx, await tokenizing.run(parse_chat, body, ctx))

    async def _generate(request: Request, ctx: ModelContext, req: GenerationRequest) -> Response:
        rid = new_id(req.kind)
        builder = ResponseBuilder(req, req.model, rid, ctx.tokenizer)
        now = time.monotonic()
        choices = [
            _ChoiceRun(
                i,
                dispatcher.start(
                    rid if req.n == 1 else f"{rid}-{i}",
                    req.prompt_ids,
                    _choice_params(req.params, i),
                    now,
                ),
                TextStream(ctx.tokenizer, req.params.stop),
            )
            for i in range(req.n)
        ]
        metrics.tokens.labels("prompt").inc(len(req.prompt_ids))
        try:
            if req.stream:
                # Errors before the first token still get a proper status code.
                await _until_disconnect(request, asyncio.gather(*(c.start() for c in choices)))
                return StreamingResponse(
                    _stream(choices, builder),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            done = await _until_disconnect(request, asyncio.gather(*(c.whole() for c in choices)))
            for c in choices:
                c.job.close()
            metrics.tokens.labels("completion").inc(sum(len(c.token_ids) for c in done))
            return JSONResponse(builder.whole(done, choices[0].job.prompt_logprobs))
        except _ClientGone:
            for c in choices:
                c.job.close()
            metrics.failure("client_disconnect")
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            for c in choices:
                c.job.close()
            raise

    async def _stream(choices: list[_ChoiceRun], builder: ResponseBuilder) -> AsyncIterator[str]:
        produced = 0
        try:
            head = builder.first_chunk()
            if head is not None:
                yield sse(head)
            async for c, (delta, new, reason, logprobs) in _merged(choices):
                produced += len(new)
                if delta or reason or (builder.req.return_token_ids and new) or logprobs:
                    body = builder.chunk(delta, new, reason, logprobs, c.index)
                    if body is not None:
                        yield sse(body)
            if builder.req.include_usage:
                yield sse(builder.usage_chunk(produced))
        except ProxyError as e:
            if e.kind:
                metrics.failure(e.kind)
            yield sse(e.body())
        except (asyncio.CancelledError, GeneratorExit):
            metrics.failure("client_disconnect")
            raise
        except Exception as e:
            logger.exception("stream %s failed", builder.id)
            metrics.failure("internal")
            yield sse(ProxyError(500, f"internal error: {type(e).__name__}: {e}").body())
        finally:
            for c in choices:
                c.job.close()
            metrics.tokens.labels("completion").inc(produced)
        yield sse("[DONE]")

    return app


class Tokenizing:
    """Threads of their own that parse bodies, tokenize and render prompts: a large body
    keeps one busy while the event loop goes on answering everyone else, and the default
    executor stays free for the worker pool's Stats calls."""

    def __init__(self, threads: int = 2) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="proxy-tokenize")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n samples with seed + i (a seeded request stays repeatable)."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (INT64_MAX + 1))


class _ChoiceRun:
    """One choice of a request: its job's events turned into text pieces."""

    def __init__(self, index: int, job: Job, text: TextStream) -> None:
        self.index = index
        self.job = job
        self.text = text
        self.events = job.events()
        self.first: TokenEvent | None = None

    async def start(self) -> None:
        """Wait for the first event (errors before any token surface here)."""
        self.first = await anext(self.events, None)

    async def pieces(self):
        """(text delta, new token ids, finish reason or None, logprobs or None) until the
        request ends: at the worker's end, or at a stop string (the proxy stops reading;
        Job.close aborts the rest)."""

        async def all_events():
            if self.first is not None:
                yield self.first
            async for ev in self.events:
                yield ev

        async for ev in all_events():
            delta = self.text.push(ev.token_ids)
            if self.text.stopped:
                yield delta, ev.token_ids, "stop", ev.logprobs
                return
            if ev.finished:
                reason = finish_reason(ev.finish_reason)
                yield delta + self.text.flush(), ev.token_ids, reason, ev.logprobs
                return
            yield delta, ev.token_ids, None, ev.logprobs
        raise ProxyError(500, "the request ended without an answer", kind="decode_error")

    async def whole(self) -> Choice:
        out = Choice(self.index)
        parts: list[str] = []
        logprobs: list | None = None
        async for delta, new, end, lps in self.pieces():
            parts.append(delta)
            out.token_ids += new
            out.reason = end or out.reason
            if lps is not None:
                logprobs = (logprobs or []) + lps
        out.text = "".join(parts)
        if self.job.params.logprobs is not None:
            out.logprobs = logprobs or []
        return out


async def _merged(choices: list[_ChoiceRun]):
    """(choice, piece) from every choice as they come; the first error ends it all."""
    if len(choices) == 1:
        async for piece in choices[0].pieces():
            yield choices[0], piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _ChoiceRun) -> None:
        try:
            async for piece in c.pieces():
                await queue.put((c, piece, None))
        except Exception as e:  # handed to the consumer
            await queue.put((c, None, e))
        await queue.put((c, None, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            c, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                running -= 1
                continue
            yield c, piece
    finally:
        for t in tasks:
            t.cancel()


#: Largest request body accepted (413 past it): a 4 MiB prompt is far past any context here.
MAX_BODY_BYTES = 16 * 2**20
#: Deepest JSON nesting accepted in a body (no OpenAI request nests past a handful).
MAX_JSON_DEPTH = 32


async def _json(request: Request, run):
    """The body as JSON: read up to MAX_BODY_BYTES (413 past it, however it is sent), then
    parsed and checked by `run` (a thread: a large body never holds up the event loop)."""
    too_big = ProxyError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise too_big
        parts.append(part)
    if not size:
        raise bad_request("the request body is empty: expected a JSON object")
    return await run(_parse_json, b"".join(parts))


def _parse_json(raw: bytes):
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json(body)
    return body


def _check_json(value, depth: int = 0) -> None:
    """Bounded nesting, and strings that are valid Unicode (no lone surrogates, which JSON
    escapes can smuggle in and nothing downstream can encode)."""
    if depth > MAX_JSON_DEPTH:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the request body holds a string that is not valid UTF-8") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_json(k, depth + 1)
            _check_json(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_json(v, depth + 1)


async def _until_disconnect(request: Request, awaitable):
    """Await `awaitable`, unless the client goes away first (then cancel it: _ClientGone)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
    if task.done() and not task.cancelled():
        return task.result()
    raise _ClientGone()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
