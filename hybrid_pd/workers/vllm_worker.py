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

Logprobs: vLLM's raw log-probabilities (its default `logprobs_mode`, the same distribution
our engine scores), tokens named by id (`return_tokens_as_token_ids`). vLLM does not stream
prompt logprobs, so a Generate that asks for them is one non-streamed call answered in one
chunk.

Abort(request id): a relayed call still running is cancelled (its HTTP request closes and
vLLM aborts the request); a prefill this service handed over has its lease dropped at once
through the connector's KVControl Abort. Without the control-plane secret only the caller
that shows the transfer token may drop a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections import OrderedDict

import grpc
import httpx

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.api.wire import card_to_pb, logprob_to_pb, sampling_from_pb
from hybrid_pd.connector.control import AioServer, call_metadata
from hybrid_pd.proto import kv_control_pb2, kv_control_pb2_grpc
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
from hybrid_pd.workers.vllm_server import parse_metrics
from hybrid_pd.workers.vllm_wire import (
    PARAMS_KEY,
    _body,
    _card,
    _output_logprobs,
    _prompt_logprobs,
    _vllm_params,
)

__all__ = ["PARAMS_KEY", "VllmWorker", "_vllm_params"]

logger = logging.getLogger(__name__)

#: Requests this service relays at once before answering RESOURCE_EXHAUSTED.
DEFAULT_MAX_QUEUED = 256
#: Handed-over prefills remembered for Abort (oldest forgotten first; their leases expire).
_REMEMBERED = 4096
#: How long an Abort waits for the vLLM connector's KVControl service.
_ABORT_TIMEOUT_S = 5.0


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
        self.secret = secret
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
        self._calls: dict[str, set[asyncio.Task]] = {}  # request id -> running relays
        self._kept: OrderedDict[str, KVTransferParams] = OrderedDict()  # handed over
        self._control: dict[str, kv_control_pb2_grpc.KVControlStub] = {}

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
        prompt = list(request.prompt_ids)
        body = _body(await self._model_id(context), prompt, params, max_tokens=1)
        hand_over = params.max_tokens > 1  # else the first token is the whole answer
        if hand_over:
            body["kv_transfer_params"] = {"do_remote_decode": True}
        async with self._admitted(context), self._call(request.request_id):
            reply = await self._post(context, body)
        choice = reply["choices"][0]
        token_ids = choice.get("token_ids") or []
        if len(token_ids) != 1:
            await context.abort(grpc.StatusCode.INTERNAL, "vLLM returned no first token")
        reason = choice.get("finish_reason") or "length"
        kv = (reply.get("kv_transfer_params") or {}).get(PARAMS_KEY)
        out = pb.PrefillReply(first_token=token_ids[0])
        try:
            if params.logprobs is not None:
                out.first_logprob.CopyFrom(
                    logprob_to_pb(_output_logprobs(choice, params.logprobs)[0])
                )
            if params.prompt_logprobs is not None:
                scored = _prompt_logprobs(choice, prompt, params.prompt_logprobs)
                out.prompt_logprobs.extend(logprob_to_pb(lp) for lp in scored)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"vLLM's logprobs: {e!r}")
        if not hand_over or reason != "length" or kv is None:
            out.finished = True
            out.finish_reason = reason
            return out
        try:
            params_out = KVTransferParams.from_dict(kv)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"vLLM's connector sent {e}")
        out.kv_transfer_params.CopyFrom(params_out.to_pb())
        if request.request_id:
            self._kept[request.request_id] = params_out
            while len(self._kept) > _REMEMBERED:
                self._kept.popitem(last=False)
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
            if kv.staged:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "a vLLM decode worker takes no staged kv_transfer_params (overlap_transfer "
                    "needs engine hybrid-pd)",
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
        known = [None] * len(resumed)  # tokens computed elsewhere carry no logprobs here
        async with self._admitted(context), self._call(request.request_id):
            if params.prompt_logprobs is not None:  # vLLM streams none: one whole answer
                yield await self._whole(context, body, prompt, params, resumed, known)
                return
            body.update(stream=True)
            if resumed:
                chunk = pb.GenerateChunk(token_ids=resumed)
                if params.logprobs is not None:
                    chunk.logprobs.extend(logprob_to_pb(lp) for lp in known)
                yield chunk
            async for chunk in self._stream(context, body):
                yield chunk

    async def _whole(self, context, body, prompt, params, resumed, known) -> pb.GenerateChunk:
        reply = await self._post(context, body)
        choice = reply["choices"][0]
        reason = choice.get("finish_reason") or "length"
        out = pb.GenerateChunk(
            token_ids=resumed + list(choice.get("token_ids") or []),
            finished=True,
            finish_reason=reason,
        )
        try:
            scored = _prompt_logprobs(choice, body["prompt"], params.prompt_logprobs)
            out.prompt_logprobs.extend(logprob_to_pb(lp) for lp in scored[: len(prompt)])
            if params.logprobs is not None:
                lps = known + _output_logprobs(choice, params.logprobs)
                out.logprobs.extend(logprob_to_pb(lp) for lp in lps)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"vLLM's logprobs: {e!r}")
        return out

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
                        chunk = pb.GenerateChunk(
                            token_ids=choice.get("token_ids") or [],
                            finished=reason is not None,
                            finish_reason=reason or "",
                        )
                        if body.get("logprobs") is not None and chunk.token_ids:
                            lps = _output_logprobs(choice, body["logprobs"])
                            chunk.logprobs.extend(logprob_to_pb(lp) for lp in lps)
                        yield chunk
                        if reason is not None:
                            return
        except httpx.TransportError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM server {self.w.url}: {e}")

    # -- the rest ---------------------------------------------------------------------------
    async def Abort(self, request, context):
        """Cancel the relays running for the id and drop the lease of a prefill handed over
        under it. Without the control-plane secret (the server's interceptor checks it
        where there is one) only a caller showing the transfer token drops a lease."""
        rid = request.request_id
        kv = self._kept.get(rid)
        if self.w.secret is None:
            token = request.transfer_token.encode()
            if (
                kv is None
                or not token
                or not hmac.compare_digest(kv.transfer_token.encode(), token)
            ):
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "Abort needs the control-plane secret or the request's transfer token "
                    "(cancel your own call to stop it)",
                )
        found = False
        for task in self._calls.get(rid, ()):
            task.cancel()
            found = True
        if kv is not None:
            del self._kept[rid]
            found = await self._drop_lease(kv) or found
        return pb.AbortReply(ok=found)

    async def _drop_lease(self, kv: KVTransferParams) -> bool:
        stub = self._control.get(kv.control_address)
        if stub is None:
            channel = grpc.aio.insecure_channel(kv.control_address)
            stub = self._control[kv.control_address] = kv_control_pb2_grpc.KVControlStub(channel)
        try:
            reply = await stub.Abort(
                kv_control_pb2.AbortRequest(
                    request_id=kv.request_id, transfer_token=kv.transfer_token
                ),
                timeout=_ABORT_TIMEOUT_S,
                metadata=call_metadata(self.w.secret),
            )
        except grpc.RpcError as e:
            logger.warning("abort of %s at %s failed: %s", kv.request_id, kv.control_address, e)
            return False
        return reply.ok

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
    async def _call(self, request_id: str):
        """Register the running relay under `request_id` for Abort."""
        task = asyncio.current_task()
        if not request_id or task is None:
            yield
            return
        self._calls.setdefault(request_id, set()).add(task)
        try:
            yield
        finally:
            tasks = self._calls.get(request_id, set())
            tasks.discard(task)
            if not tasks:
                self._calls.pop(request_id, None)

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
    if params.constraint is not None:
        # vLLM's decode server would have to replay the first token into its own grammar
        # state; until that is checked exact, refuse rather than constrain half the output
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "structured output is not supported with --engine vllm",
        )
    return params
