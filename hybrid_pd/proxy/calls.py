"""The gRPC request pieces of a request's legs: what a Prefill and a Generate call carry,
and whether a request wants a prefill leg at all. Pure: no I/O, no worker state."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_pd.api.ids import RequestId
from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.api.wire import sampling_to_pb
from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proxy.worker_client import PrefillResult


@dataclass(frozen=True)
class PrefillCall:
    #: The worker-side id of this leg (the client's id with the leg and attempt).
    request_id: RequestId
    prompt_ids: list[int]
    sampling: pb.Sampling


@dataclass(frozen=True)
class DecodeCall:
    #: The worker-side id of this leg (the client's id with the leg and attempt).
    request_id: RequestId
    prompt_ids: list[int]
    sampling: pb.Sampling
    kv_transfer_params: KVTransferParams | None = None
    failure_policy: str = ""
    output_ids: tuple[int, ...] = ()


def wants_prefill(prompt_len: int, min_prefill_tokens: int, num_prefill_workers: int) -> bool:
    """Short prompts (and pools without prefill workers) go straight to a decode worker."""
    return num_prefill_workers > 0 and prompt_len >= min_prefill_tokens


def prepare_prefill_request(
    request_id: str, prompt_ids: list[int], params: SamplingParams, attempt: int = 0
) -> PrefillCall:
    """The Prefill leg of a request. Each attempt has its own worker-side id (`-p<attempt>`),
    so the decode leg (`-d...`) never collides with it, even on a worker of role `both`."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    rid = RequestId(f"{request_id}-p{attempt}")
    return PrefillCall(rid, list(prompt_ids), sampling_to_pb(params))


def prepare_decode_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    prefill: PrefillResult | None = None,
    failure_policy: str = "",
    attempt: int = 0,
    output_ids: list[int] | tuple[int, ...] = (),
) -> DecodeCall:
    """The Generate leg: with `prefill` (its KV kept on a prefill worker) decode pulls the
    KV and continues after the first token; without it the decode worker runs it all, after
    `output_ids` when given (a migrated stream: tokens already produced elsewhere)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if prefill is not None and output_ids:
        raise ValueError("a decode leg resumes either from kv_transfer_params or output_ids")
    kv = None
    if prefill is not None:
        if prefill.finished or prefill.kv_transfer_params is None:
            raise ValueError("the prefill already finished the request: nothing to decode")
        kv = prefill.kv_transfer_params
        if kv.prompt_len != len(prompt_ids):
            raise ValueError("kv_transfer_params do not describe this prompt")
    return DecodeCall(
        RequestId(f"{request_id}-d{attempt}"),
        list(prompt_ids),
        sampling_to_pb(params),
        kv,
        failure_policy,
        tuple(output_ids),
    )
