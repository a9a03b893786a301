"""The scheduler half of the vLLM connector (vLLM's EngineCore process): it decides.

Decode: a request carrying our kv_transfer_params continues from the prefill's first token;
the scheduler allocates its blocks and the step's metadata asks the worker half to pull them.
Prefill: a request that finished at its first token has its blocks kept (leased) for the
decode server, and kv_transfer_params name them.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from hybrid_pd.api.params import KVTransferParams, prompt_digest
from hybrid_pd.api.signing import refusal
from hybrid_pd.connector import timeline
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.prefill import handover_params
from hybrid_pd.connector.vllm.clip import BlockClipper
from hybrid_pd.connector.vllm.first_token import REPLY_KEY, FirstTokens
from hybrid_pd.connector.vllm.metadata import HybridPDHandshake, HybridPDMetadata, Load, Send
from hybrid_pd.kvcache.ids import EngineId

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: Our fields inside vLLM's kv_transfer_params.
PARAMS_KEY = "hybrid_pd"
#: How long the scheduler waits for a peer's layout to name a mismatch (once per peer).
_HANDSHAKE_TIMEOUT_S = 2.0


class SchedulerHalf:
    """What the scheduler side of `HybridPDConnector` does (vLLM calls it through the
    connector): state for the next step's metadata and for decode requests whose params are
    not planned into a load yet."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        engine_id: EngineId,
        layout: KVLayout,
        clipper: BlockClipper,
        is_producer: bool,
        control_address: str | None,
        peers: tuple[str, ...],
        secret: str | None,
        lease_s: float,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.engine_id = engine_id
        self.layout = layout
        self.clipper = clipper
        self.is_producer = is_producer
        #: Where decode servers pull from: the configured port, else the worker half's
        #: (through the handshake metadata vLLM collects), else None until then.
        self.control_address = control_address
        self.peers = peers
        self.secret = secret
        #: How long the params handed out are signed for (the worker half's lease).
        self.lease_s = lease_s
        self._meta = HybridPDMetadata()
        self._pending: dict[str, KVTransferParams] = {}
        self._differences: dict[tuple[str, str], str] = {}  # why a peer's layout differs
        #: Loads planned, not yet stepped: this server's request id -> the prefill's (the
        #: id the hand-off's timeline is stamped under).
        self._loading: dict[str, str] = {}
        self.first_tokens = FirstTokens()

    def on_new_request(self, request: Request) -> None:
        """Decode: a request carrying our kv_transfer_params continues from the prefill's
        first token: append it to the prompt, so the step after the load computes that
        token at position N from h(N), the single-instance order."""
        raw = request.kv_transfer_params
        if not (raw and raw.get("do_remote_prefill") and PARAMS_KEY in raw):
            return
        raw["do_remote_prefill"] = False  # one load per request, whatever happens
        try:
            params = KVTransferParams.from_dict(raw[PARAMS_KEY])
        except ValueError as e:
            logger.warning(
                "request %s: bad kv_transfer_params (%s); computing locally", request.request_id, e
            )
            return
        reason = self._unfit(request, params, raw[PARAMS_KEY])
        if reason:
            logger.warning(
                "request %s: %s; computing the prompt locally", request.request_id, reason
            )
            self._meta.drops.append(params)
            return
        request.prompt_token_ids = [*request.prompt_token_ids, params.first_token]
        request._all_token_ids.append(params.first_token)
        request.num_prompt_tokens += 1
        request.max_tokens -= 1
        request.update_block_hashes()
        self._pending[request.request_id] = params
        timeline.stamp(params.request_id, "decode_arrived")
        if _replies_first_token(request):
            self.first_tokens.owe(request.request_id, params.first_token)

    def _unfit(self, request: Request, params: KVTransferParams, raw: dict) -> str | None:
        prompt = request.prompt_token_ids
        if prompt is None or request.prompt_embeds is not None:
            return "prompt embeddings cannot take a remote prefill"
        if len(prompt) != params.prompt_len:
            return (
                f"kv_transfer_params were made for another prompt ({params.prompt_len} "
                f"tokens, this one has {len(prompt)})"
            )
        if raw.get("prompt_digest") != prompt_digest(prompt):
            return "kv_transfer_params were made for another prompt (its digest differs)"
        if params.fingerprint != self.layout.fingerprint:
            reason = self._layout_difference(params)
            if reason:  # else a server of another TP size whose caches map onto ours
                return reason
        if request.use_structured_output:
            # vLLM's grammar for the request starts after the prompt, and the prefill's
            # token is prompt here: it would be constrained as if it came first
            return "structured output is computed here (the grammar would miss the first token)"
        sampling = request.sampling_params
        if _replies_first_token(request) and sampling is not None and sampling.logprobs is not None:
            # the prefill's params carry its first token, not that token's logprobs
            return "logprobs asked of a reply that starts with the prefill's token"
        if request.max_tokens < 2:
            # The prefill already produced the only token; computing here is exact too.
            return "max_tokens < 2 leaves nothing to decode"
        if request.num_tokens >= self._vllm_config.model_config.max_model_len:
            return "the prompt fills max_model_len"
        return None

    def _layout_difference(self, params: KVTransferParams) -> str:
        """Why the prefill server's layout differs: its KVControl Handshake names the field
        (asked once per peer and fingerprint, only of configured peers; the scheduler waits
        for it at most `_HANDSHAKE_TIMEOUT_S`, on the first such request only). "": it
        differs only as a server of another tensor-parallel size whose caches map onto
        this one's (`rank_plan`): the worker ranks pull their pieces."""
        key = (params.control_address, params.fingerprint)
        known = self._differences.get(key)
        if known is not None:
            return known
        reason = "the prefill server's KV layout differs from this server's"
        if params.control_address in self.peers or (
            params.signature and refusal(params, self.secret) is None
        ):
            import grpc

            from hybrid_pd.connector.control import call_metadata, layout_from_pb, layout_to_pb
            from hybrid_pd.proto import kv_control_pb2 as kpb
            from hybrid_pd.proto import kv_control_pb2_grpc as kgrpc

            channel = grpc.insecure_channel(params.control_address)
            try:
                ask = kpb.HandshakeRequest(
                    engine_id=self.engine_id, layout=layout_to_pb(self.layout)
                )
                reply = kgrpc.KVControlStub(channel).Handshake(
                    ask,
                    timeout=_HANDSHAKE_TIMEOUT_S,
                    metadata=call_metadata(self.secret),
                )
                peer = layout_from_pb(reply.layout)
                diff = self.layout.difference(peer)
                mapped = diff is None and peer.tp_size != self.layout.tp_size
                reason = "" if mapped and peer.fingerprint == params.fingerprint else diff or reason
            except grpc.RpcError as e:
                reason += f" (its layout could not be read: {e.code().name})"
            finally:
                channel.close()
        if len(self._differences) < 64:
            self._differences[key] = reason
        return reason

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = self._pending.get(request.request_id)
        if params is None:
            return 0, False
        count = params.prompt_len - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids  # a load restores every group

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._pending.pop(request.request_id, None)
        if params is None:
            return
        if num_external_tokens == 0:  # decode holds the whole prompt already
            self._meta.drops.append(params)
            return
        local = self.clipper.clip(blocks.get_unhashed_block_ids_all_groups())
        self._meta.loads.append(Load(request.request_id, params, local))
        if timeline.enabled():
            timeline.stamp(params.request_id, "load_planned")
            self._loading[request.request_id] = params.request_id

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._meta = self._meta, HybridPDMetadata()
        meta.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        if timeline.enabled():
            self._stamp_step(meta, scheduler_output)
        return meta

    def _stamp_step(self, meta: HybridPDMetadata, scheduler_output: Any) -> None:
        """Timeline: keeps handed to the worker half, and loaded requests' first step."""
        for s in meta.sends:
            timeline.stamp(s.request_id, "keep_meta")
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for rid in [r for r in self._loading if r in scheduled]:
            if any(ld.request_id == rid for ld in meta.loads):
                continue  # planned in this very step: its load has not begun
            timeline.stamp(self._loading.pop(rid), "first_step")

    def update_connector_output(self, connector_output: Any) -> None:
        """Timeline: the loads vLLM's scheduler heard had finished."""
        if not self._loading:
            return
        for rid in connector_output.finished_recving or ():
            if rid in self._loading:
                timeline.stamp(self._loading[rid], "finished_seen")

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.first_tokens.ended(request.request_id)
        self._loading.pop(request.request_id, None)
        params = self._pending.pop(request.request_id, None)
        if params is not None:  # decode: finished before its load was planned
            self._meta.drops.append(params)
            return False, None
        raw = request.kv_transfer_params
        if not (self.is_producer and raw and raw.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or (
            request.num_output_tokens != 1
        ):
            # Stopped at its first token (nothing to decode), aborted, or asked for more
            # than one token: no hand-off; a decode request without params computes alone.
            return False, None
        if self.control_address is None:
            logger.error(
                "hybrid-pd connector: no control address yet; %s not handed over",
                request.request_id,
            )
            return False, None
        kept = self.clipper.clip(block_ids)
        token = secrets.token_urlsafe(32)
        self._meta.sends.append(Send(request.request_id, token, kept))
        kv = handover_params(
            self,
            request.request_id,
            kept,
            request.prompt_token_ids,
            request.output_token_ids[0],
            token,
        ).to_dict()
        timeline.stamp(request.request_id, "params_out")
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            PARAMS_KEY: kv,
        }

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        # rank 0's address goes into kv_transfer_params (rank r serves at its port + r)
        for _, meta in sorted(metadata.items(), key=lambda kv: kv[0] != 0):
            if isinstance(meta, HybridPDHandshake) and self.control_address is None:
                self.control_address = meta.control_address


def _replies_first_token(request: Request) -> bool:
    """Whether decode's reply starts with the prefill's first token (`first_token`): yes
    unless the request's kv_transfer_params say `reply_first_token: false`."""
    return (request.kv_transfer_params or {}).get(REPLY_KEY, True) is not False
