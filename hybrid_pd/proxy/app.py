"""The OpenAI-compatible HTTP front door: `build_app(config, pool)` -> FastAPI app."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from hybrid_pd.proxy.responses import ResponseBuilder, finish_reason, new_id, sse
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
        body = await _json(request)
        ctx = await served.context()
        ids = await asyncio.to_thread(parse_tokenize, body, ctx)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await _json(request)
        ctx = await served.context()
        return {"prompt": await asyncio.to_thread(parse_detokenize, body, ctx)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        # Parsing tokenizes: a thread keeps a huge prompt from stalling everyone else.
        body = await _json(request)
        ctx = await served.context()
        return await _generate(request, ctx, await asyncio.to_thread(parse_completion, body, ctx))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json(request)
        ctx = await served.context()
        return await _generate(request, ctx, await asyncio.to_thread(parse_chat, body, ctx))

    async def _generate(request: Request, ctx: ModelContext, req: GenerationRequest) -> Response:
        rid = new_id(req.kind)
        builder = ResponseBuilder(req, req.model, rid)
        job = dispatcher.start(rid, req.prompt_ids, req.params, time.monotonic())
        metrics.tokens.labels("prompt").inc(len(req.prompt_ids))
        text = TextStream(ctx.tokenizer, req.params.stop)
        events = job.events()
        try:
            if req.stream:
                # Errors before the first token still get a proper status code.
                first = await _until_disconnect(request, anext(events, None))
                return StreamingResponse(
                    _stream(job, first, events, text, builder),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            body = await _until_disconnect(request, _whole(events, text, builder))
            job.close()
            return JSONResponse(body)
        except _ClientGone:
            job.close()
            metrics.failure("client_disconnect")
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            job.close()
            raise

    async def _whole(events, text: TextStream, builder: ResponseBuilder) -> dict:
        parts: list[str] = []
        ids: list[int] = []
        reason = "stop"
        async for delta, new, end in _pieces(None, events, text):
            parts.append(delta)
            ids += new
            reason = end or reason
        metrics.tokens.labels("completion").inc(len(ids))
        return builder.whole("".join(parts), ids, reason)

    async def _stream(
        job: Job, first, events, text: TextStream, builder: ResponseBuilder
    ) -> AsyncIterator[str]:
        produced = 0
        try:
            head = builder.first_chunk()
            if head is not None:
                yield sse(head)
            async for delta, new, reason in _pieces(first, events, text):
                produced += len(new)
                if delta or reason or (builder.req.return_token_ids and new):
                    yield sse(builder.chunk(delta, new, reason))
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
            job.close()
            metrics.tokens.labels("completion").inc(produced)
        yield sse("[DONE]")

    return app


async def _pieces(first: TokenEvent | None, events, text: TextStream):
    """(text delta, new token ids, finish reason or None) until the request ends: at the
    worker's end, or at a stop string (the proxy stops reading; Job.close aborts the rest)."""

    async def all_events():
        if first is not None:
            yield first
        async for ev in events:
            yield ev

    async for ev in all_events():
        delta = text.push(ev.token_ids)
        if text.stopped:
            yield delta, ev.token_ids, "stop"
            return
        if ev.finished:
            yield delta + text.flush(), ev.token_ids, finish_reason(ev.finish_reason)
            return
        yield delta, ev.token_ids, None
    raise ProxyError(500, "the request ended without an answer", kind="decode_error")


#: Largest request body accepted (413 past it): a 4 MiB prompt is far past any context here.
MAX_BODY_BYTES = 16 * 2**20
#: Deepest JSON nesting accepted in a body (no OpenAI request nests past a handful).
MAX_JSON_DEPTH = 32


async def _json(request: Request):
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ProxyError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ProxyError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    if not raw:
        raise bad_request("the request body is empty: expected a JSON object")
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
