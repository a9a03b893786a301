"""The Worker gRPC service: Prefill (prefill role), Generate (decode role or local), Abort."""

from __future__ import annotations

import json
import logging
import time

import grpc

from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.params import KVTransferParams
from hybrid_pd.engine.loop import RequestFailed, next_output
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

#: While decode waits for free blocks, it extends the prefill lease this often.
HEARTBEAT_S = 5.0


def sampling_from_pb(msg: pb.Sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens or 16,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p or 1.0,
        seed=msg.seed if msg.has_seed else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
    )


def sampling_to_pb(p: SamplingParams) -> pb.Sampling:
    return pb.Sampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        has_seed=p.seed is not None,
        seed=p.seed or 0,
        stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop),
        ignore_eos=p.ignore_eos,
    )


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, worker) -> None:
        self.w = worker

    # -- prefill ----------------------------------------------------------------------------
    def Prefill(self, request, context):
        if self.w.prefill is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a prefill worker")
        try:
            params = sampling_from_pb(request.sampling)
            rid, q = self.w.loop.submit(
                list(request.prompt_ids), params, request.request_id or None, remote_decode=True
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        context.add_callback(lambda: self._abort_if_pending(rid, q))
        try:
            out = next_output(q, self.w.config.request_timeout_s)
        except RequestFailed as e:
            self.w.loop.abort(rid)
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e}")
        kv = out.kv_transfer_params
        return pb.PrefillReply(
            first_token=out.token_ids[0],
            finished=kv is None,
            finish_reason=out.finish_reason or "",
            kv_transfer_params_json=json.dumps(kv) if kv else "",
        )

    def _abort_if_pending(self, rid: str, q) -> None:
        # Client went away before the first token: drop the request (no-op when finished).
        self.w.loop.abort(rid)

    # -- generate ---------------------------------------------------------------------------
    def Generate(self, request, context):
        try:
            params = sampling_from_pb(request.sampling)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_ids)
        rid = request.request_id or None
        transfer = pb.TransferStats()
        try:
            if request.kv_transfer_params_json:
                if self.w.decode is None:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
                rid, q, transfer = self._start_remote(request, prompt, params, rid)
            else:
                rid, q = self.w.loop.submit(prompt, params, rid)
        except (ValueError, TransferFailed) as e:
            code = (
                grpc.StatusCode.INVALID_ARGUMENT
                if isinstance(e, ValueError)
                else grpc.StatusCode.UNAVAILABLE
            )
            context.abort(code, str(e))
        context.add_callback(lambda: self.w.loop.abort(rid))
        sent = 0
        first = True
        while True:
            try:
                out = next_output(q, self.w.config.request_timeout_s)
            except RequestFailed as e:
                yield pb.GenerateChunk(finished=True, finish_reason="error", error=str(e))
                return
            new = out.token_ids[sent:]
            sent = len(out.token_ids)
            chunk = pb.GenerateChunk(
                token_ids=new, finished=out.finished, finish_reason=out.finish_reason or ""
            )
            if first:
                chunk.transfer.CopyFrom(transfer)
                first = False
            yield chunk
            if out.finished:
                return

    def _start_remote(self, request, prompt, params, rid):
        """Reserve blocks, pull the KV, admit the request; apply the failure policy."""
        kv = KVTransferParams.from_dict(json.loads(request.kv_transfer_params_json))
        if kv.prompt_len != len(prompt):
            raise ValueError(
                f"kv_transfer_params.prompt_len is {kv.prompt_len} but the prompt "
                f"has {len(prompt)} tokens"
            )
        rid = rid or kv.request_id
        policy = request.failure_policy or self.w.config.failure_policy
        if policy not in ("recompute", "fail"):
            raise ValueError("failure_policy must be 'recompute' or 'fail'")
        engine = self.w.engine
        deadline = time.monotonic() + self.w.config.transfer_timeout_s
        next_beat = time.monotonic() + HEARTBEAT_S
        while (
            res := self.w.loop.call(engine.reserve_remote, rid, prompt, kv.first_token, params)
        ) is None:
            now = time.monotonic()
            if now > deadline:  # the pool stayed full: give the KV back, maybe recompute
                self.w.decode.abort(kv)
                if policy == "fail":
                    raise TransferFailed("decode worker has no free KV blocks for this request")
                rid, q = self.w.loop.submit(prompt, params, rid, output_ids=[kv.first_token])
                return rid, q, pb.TransferStats(recomputed=True)
            if now > next_beat:  # keep the prefill worker's lease alive while we wait
                self.w.decode.heartbeat([kv])
                next_beat = now + HEARTBEAT_S
            time.sleep(0.01)
        req, block_ids = res
        try:
            stats = self.w.decode.pull(kv, block_ids)
        except TransferFailed as e:
            self.w.loop.call(engine.cancel_remote, req)
            logger.warning("KV pull for %s failed: %s (policy %s)", rid, e, policy)
            if policy == "fail":
                raise
            rid, q = self.w.loop.submit(prompt, params, rid, output_ids=[kv.first_token])
            return rid, q, pb.TransferStats(recomputed=True)
        q = self.w.loop.adopt(rid, lambda: engine.activate_remote(req))
        return (
            rid,
            q,
            pb.TransferStats(bytes=stats.bytes, messages=stats.messages, seconds=stats.seconds),
        )

    def Abort(self, request, context):
        """Abort a request wherever it is: queued, running, or kept for a decode worker."""
        found = self.w.loop.abort(request.request_id)
        if self.w.prefill is not None:
            found = self.w.prefill.abort_request(request.request_id) or found
        return pb.AbortReply(ok=found)

    def Stats(self, request, context):
        return pb.StatsReply(json=json.dumps(self.w.stats()))
