"""The Prefill RPC: run a prompt to its first token and keep its KV for a decode worker.

Prefill(prompt, sampling, transfer_token) ──► engine (remote_decode: stop after the
first token; the prefill connector leases the blocks) ──► PrefillReply(first token,
kv_transfer_params: where and how a decode worker pulls the KV)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.wire import logprob_to_pb
from hybrid_pd.engine.loop import RequestFailed
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.workers.stream import open_stream, sampling_of

if TYPE_CHECKING:
    from hybrid_pd.workers.worker import Worker

#: Longest transfer token a caller may choose (overlapped hand-over).
MAX_TRANSFER_TOKEN = 256


class PrefillService:
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def Prefill(self, request, context):
        params = await sampling_of(request.sampling, context)
        if len(request.transfer_token) > MAX_TRANSFER_TOKEN:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_token is too long")
        stream = await open_stream(
            self.w,
            context,
            list(request.prompt_ids),
            params,
            request.request_id or None,
            remote_decode=True,
            stage_token=request.transfer_token or None,
        )
        try:
            out = await stream.next(self.w.config.request_timeout_s)
        except RequestFailed as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e}")
        finally:
            stream.close()
        kv = out.kv_transfer_params  # the prefill connector's dict (engine contract)
        reply = pb.PrefillReply(
            first_token=out.token_ids[0],
            finished=kv is None,
            finish_reason=out.finish_reason or "",
        )
        if kv is not None:
            reply.kv_transfer_params.CopyFrom(KVTransferParams.from_dict(kv).to_pb())
        if out.logprobs is not None:
            reply.first_logprob.CopyFrom(logprob_to_pb(out.logprobs[0]))
        if out.prompt_logprobs is not None:
            reply.prompt_logprobs.extend(logprob_to_pb(lp) for lp in out.prompt_logprobs)
        return reply
