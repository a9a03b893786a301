"""The Worker service in front of a vLLM OpenAI server that runs hybrid-pd's connector.

The proxy speaks one gRPC API to every worker (Prefill, Generate, Abort, Stats, Health,
Describe). This service answers it for a vLLM server on the same host by turning each call
into the HTTP requests vLLM's own disaggregation examples make:

    Prefill(prompt, sampling)        -> POST /v1/completions  max_tokens 1,
                                        kv_transfer_params {"do_remote_decode": true}
                                     <- first token + the connector's kv_transfer_params
    Generate(prompt, sampling, kv)   -> POST /v1/completions  stream, kv_transfer_params
                                        (vLLM's connector appends the first token itself)
                                     <- the first token, then vLLM's tokens as they come

so the proxy's routing, backpressure, retries and stream migration serve vLLM pools as they
serve our own engine. It imports no vLLM (the server runs under whichever Python has it).
Logprobs are not relayed yet: such requests get INVALID_ARGUMENT (a 400 at the proxy).
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from pathlib import Path

import grpc
import httpx

from hybrid_pd.api.card import ModelCard
from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.api.wire import card_to_pb, sampling_from_pb
from hybrid_pd.connector.control import AioServer
from hybrid_pd.connector.vllm_servers import parse_metrics
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

#: Where vLLM's connector keeps our params inside its kv_transfer_params.
PARAMS_KEY = "hybrid_pd"
#: Requests this service relays at once before answering RESOURCE_EXHAUSTED.
DEFAULT_MAX_QUEUED = 256


class VllmWorker:
    """A gRPC Worker service on `host:port` for the vLLM server at `url` (role "prefill"
    or "decode", as the server's kv_role), serving `model` (a checkpoint folder)."""

    def __init__(
        self,
        url: str,
        role: str,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | None = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.url = url
        self.role = role
        self.model = model
        self.max_queued = max_queued
        self.engine_id = f"vllm-{role}-{uuid.uuid4().hex[:10]}"
        self.server = AioServer(f"{host}:{port}", secret)
        self.address = f"{host}:{self.server.port}"
        service = _Servicer(self)
        self.server.add(lambda s: pb_grpc.add_WorkerServicer_to_server(service, s))
        self.server.start()
        logger.info(
            "vLLM %s worker %s serving on %s for %s", role, self.engine_id, self.address, url
        )

    def close(self) -> None:
        self.server.stop(grace=1.0)


class _Servicer(pb_grpc.WorkerServicer):
    def __init__(self, w: VllmWorker) -> None:
        self.w = w
        self._http: httpx.AsyncClient | None = None  # made on the server's loop
        self._card: pb.ModelCard | None = None
        self._served: dict | None = None  # the server's /v1/models entry
        self.inflight = 0

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.w.url, timeout=httpx.Timeout(None))
        return self._http

    # -- prefill ----------------------------------------------------------------------------
    async def Prefill(self, request, context):
        if self.w.role != "prefill":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a prefill worker")
        params = await _sampling(request.sampling, context)
        body = _body(await self._model_id(context), request.prompt_ids, params, max_tokens=1)
        hand_over = params.max_tokens > 1  # else the first token is the whole answer
        if hand_over:
            body["kv_transfer_params"] = {"do_remote_decode": True}
        async with self._admitted(context):
            reply = await self._post(context, body)
        choice = reply["choices"][0]
        token_ids = choice.get("token_ids") or []
        if len(token_ids) != 1:
            await context.abort(grpc.StatusCode.INTERNAL, "vLLM returned no first token")
        reason = choice.get("finish_reason") or "length"
        kv = (reply.get("kv_transfer_params") or {}).get(PARAMS_KEY)
        out = pb.PrefillReply(first_token=token_ids[0])
        if not hand_over or reason != "length" or kv is None:
            out.finished = True
            out.finish_reason = reason
            return out
        try:
            out.kv_transfer_params.CopyFrom(KVTransferParams.from_dict(kv).to_pb())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"vLLM's connector sent {e}")
        return out

    # -- generate ---------------------------------------------------------------------------
    async def Generate(self, request, context):
        params = await _sampling(request.sampling, context)
        prompt = list(request.prompt_ids)
        resumed = list(request.output_ids)  # sent first: the contract is every output token
        if request.HasField("kv_transfer_params"):
            if self.w.role != "decode":
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
            if resumed:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "output_ids and kv_transfer_params exclude each other",
                )
            try:
                kv = KVTransferParams.from_pb(request.kv_transfer_params)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if kv.prompt_len != len(prompt):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "kv_transfer_params are for another prompt"
                )
            body = _body(await self._model_id(context), prompt, params, params.max_tokens)
            body["kv_transfer_params"] = _vllm_params(kv)
            resumed = [kv.first_token]
        else:
            # Run it all here: a migrated stream recomputes prompt + the tokens it had.
            left = params.max_tokens - len(resumed)
            if left < 1:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "nothing left to generate")
            body = _body(await self._model_id(context), prompt + resumed, params, left)
        body.update(stream=True)
        async with self._admitted(context):
            if resumed:
                yield pb.GenerateChunk(token_ids=resumed)
            async for chunk in self._stream(context, body):
                yield chunk

    async def _stream(self, context, body: dict):
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    await self._http_error(context, r)
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        yield pb.GenerateChunk(
                            finished=True, finish_reason="error", error=str(data["error"])
                        )
                        return
                    for choice in data.get("choices", []):
                        reason = choice.get("finish_reason")
                        yield pb.GenerateChunk(
                            token_ids=choice.get("token_ids") or [],
                            finished=reason is not None,
                            finish_reason=reason or "",
                        )
                        if reason is not None:
                            return
        except httpx.TransportError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM server {self.w.url}: {e}")

    # -- the rest ---------------------------------------------------------------------------
    async def Abort(self, request, context):
        # A relayed request ends when its caller cancels the call (the HTTP request closes
        # and vLLM aborts it); kept prefills expire by their lease on the vLLM server.
        return pb.AbortReply(ok=False)

    async def Stats(self, request, context):
        try:
            text = (await self.http.get("/metrics", timeout=2.0)).text
        except httpx.HTTPError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM server {self.w.url}: {e}")
        values = parse_metrics(text, ("vllm:",))
        total = 1000  # vLLM reports a usage fraction, not blocks: per mille of its KV cache
        used = round(total * values.get("vllm:kv_cache_usage_perc", 0.0))
        return pb.StatsReply(
            engine_id=self.w.engine_id,
            role=self.w.role,
            address=self.w.address,
            model=self.w.model,
            num_blocks=total,
            free_blocks=total - used,
            running=int(values.get("vllm:num_requests_running", 0)),
            waiting=int(values.get("vllm:num_requests_waiting", 0)),
            integrity="ok",
        )

    async def Health(self, request, context):
        try:
            ok = (await self.http.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM server {self.w.url} is down")
        return pb.HealthReply(
            engine_id=self.w.engine_id,
            role=self.w.role,
            queued=self.inflight,
            max_queued=self.w.max_queued,
        )

    async def AddPeers(self, request, context):
        # vLLM's connector dials only the peers its own config names.
        return pb.AddPeersReply(known=list(request.prefill_addresses))

    async def Describe(self, request, context):
        if self._card is None:
            served = await self._served_model(context)
            self._card = card_to_pb(_card(self.w.model, int(served["max_model_len"])))
        return self._card

    async def _served_model(self, context) -> dict:
        if self._served is None:
            try:
                self._served = (await self.http.get("/v1/models", timeout=5.0)).json()["data"][0]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM server: {e}")
        return self._served

    async def _model_id(self, context) -> str:
        return (await self._served_model(context))["id"]

    # -- helpers ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _admitted(self, context):
        """One of `max_queued` relay slots (RESOURCE_EXHAUSTED when none is free)."""
        if self.inflight >= self.w.max_queued:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "worker queue full")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    async def _post(self, context, body: dict) -> dict:
        try:
            r = await self.http.post("/v1/completions", json=body)
        except httpx.TransportError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM server {self.w.url}: {e}")
        if r.status_code != 200:
            await self._http_error(context, r)
        return r.json()

    async def _http_error(self, context, r: httpx.Response) -> None:
        code = grpc.StatusCode.INTERNAL
        if r.status_code == 400:
            code = grpc.StatusCode.INVALID_ARGUMENT
        elif r.status_code in (429, 503):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        await context.abort(code, f"vLLM answered {r.status_code}: {r.text[:300]}")


async def _sampling(msg: pb.Sampling, context) -> SamplingParams:
    try:
        params = sampling_from_pb(msg)
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if params.logprobs is not None or params.prompt_logprobs is not None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, "logprobs are not relayed from vLLM pools yet"
        )
    return params


def _body(model: str, prompt, params: SamplingParams, max_tokens: int) -> dict:
    """A vLLM completions request for token-id `prompt` with `params`."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,
        "ignore_eos": params.ignore_eos,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def _vllm_params(kv: KVTransferParams) -> dict:
    """Our params as vLLM's connector expects them in a decode request."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": kv.engine_id,
        "remote_request_id": kv.request_id,
        PARAMS_KEY: kv.to_dict(),
    }


def _card(model: str, max_model_len: int) -> ModelCard:
    folder = Path(model)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    eos = text.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
    return ModelCard(
        model=model,
        path=str(folder.resolve()),
        architecture=(config.get("architectures") or ["?"])[0],
        max_model_len=max_model_len,
        vocab_size=text.get("vocab_size"),
        eos_token_ids=eos_ids,
        identity="vllm",
    )
