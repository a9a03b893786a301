"""A worker: engine loop + role(s) + one gRPC server (Worker and KVControl services).

    Worker (shared plumbing: model, layout, UCX transport, engine loop, grpc.aio server)
      ├── PrefillRole (prefill_worker/): prefill half of the connector, KVControl service
      └── DecodeRole  (decode_worker/):  decode half of the connector, failure policy

Role "both" has both halves (aggregated mode). Plain class, testable without Ray; the Ray
actor (launcher) is a thin shell over it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from hybrid_pd.api.card import ModelCard
from hybrid_pd.connector.base import KVConnector
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.prefill import DEFAULT_LEASE_S
from hybrid_pd.connector.segments import PoolRegions
from hybrid_pd.connector.setup import add_kv_control, open_server, start_transport
from hybrid_pd.decode_worker import DecodeRole
from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.engine import Engine, EngineConfig, plan_kv_cache, plan_whole_kv_cache
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.engine.tiny import resolve_model
from hybrid_pd.engine.tp.group import SINGLE
from hybrid_pd.kvcache.tp_layout import TP_CONFIG_KEY
from hybrid_pd.prefill_worker import PrefillRole
from hybrid_pd.proto import worker_pb2_grpc
from hybrid_pd.workers import DEFAULT_MAX_QUEUED
from hybrid_pd.workers.service import WorkerServicer
from hybrid_pd.workers.tp_ranks import RankGroup

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    device: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    secret: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    failure_policy: str = "recompute"  # or "fail"
    transfer_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    #: UCX transports (UCX_TLS syntax, e.g. "tcp,self"); None: UCX's choice.
    ucx_tls: str | None = None
    #: Decode role: pack a pull's runs of blocks into a few scatter-gather UCX messages.
    kv_scatter_gather: bool = True
    max_queued: int = DEFAULT_MAX_QUEUED
    #: Decode role: prefill workers (control addresses) it may pull from at start; the
    #: proxy adds the rest (AddPeers).
    peers: tuple[str, ...] = ()
    #: Ranks of the worker's engine (one process each on this host; this one is rank 0).
    tensor_parallel_size: int = 1
    #: torch threads of each rank > 0 (rank 0: the caller's setting).
    rank_threads: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError("failure policy must be 'recompute' or 'fail'")
        if self.lease_s <= 0:
            raise ValueError("lease must be positive")
        if self.max_queued < 1:
            raise ValueError("max_queued must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine_id = f"{config.role}-{uuid.uuid4().hex[:10]}"
        path = resolve_model(config.model)
        self.ranks: RankGroup | None = None
        tp = SINGLE
        if config.tensor_parallel_size > 1:
            self.ranks = RankGroup(
                str(path),
                config.tensor_parallel_size,
                config.engine,
                config.device,
                config.rank_threads,
                share_pools=True,
                on_lost=_rank_lost,
            )
            tp = self.ranks.group
        try:
            model, hf_config, tokenizer = load_model(path, config.device, tp=tp)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        self.model_name = config.model
        kv_config, _ = plan_kv_cache(model, hf_config, config.engine)
        identity = _model_identity(hf_config, model)
        self.layout = KVLayout.of(
            kv_config, identity, plan_whole_kv_cache(model, hf_config, config.engine), tp.size
        )
        #: Every rank's pool in rank order (rank 0's alone without tensor parallelism).
        self.pools: list = []
        self.transport = start_transport(config.host, config.ucx_tls)
        self.server, self.address = open_server(config.host, config.port, config.secret)
        self.port = self.server.port

        region = PoolRegions(lambda: self.engine.pool.buffer)  # the pool, once it exists

        self.prefill: PrefillRole | None = None
        self.decode: DecodeRole | None = None
        if config.role in ("prefill", "both"):
            self.prefill = PrefillRole(
                engine_id=self.engine_id,
                layout=self.layout,
                control_address=self.address,
                transport=self.transport,
                region=region,
                lease_s=config.lease_s,
                shard_buffers=lambda: self.pools,
            )
        if config.role in ("decode", "both"):
            self.decode = DecodeRole(
                engine_id=self.engine_id,
                layout=self.layout,
                transport=self.transport,
                region=region,
                secret=config.secret,
                timeout_s=config.transfer_timeout_s,
                failure_policy=config.failure_policy,
                peers=tuple(config.peers),
                scatter_gather=config.kv_scatter_gather,
                shard_buffers=lambda: self.pools,
            )
        connector = KVConnector(
            scheduler=self.prefill.connector if self.prefill else None,
            worker=self.decode.connector if self.decode else None,
        )
        self.engine = Engine(model, hf_config, config.engine, tokenizer, connector, tp=tp)
        own = self.engine.pool.buffer
        self.pools = [own] if self.ranks is None else self.ranks.pools(own)
        self.card = ModelCard(
            model=config.model,
            path=str(path.resolve()),
            architecture=(hf_config.get("architectures") or ["?"])[0],
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            eos_token_ids=tuple(sorted(self.engine.eos_token_ids)),
            identity=identity,
        )
        self.loop = EngineLoop(self.engine)
        for role in (self.prefill, self.decode):
            if role is not None:
                role.attach(self.loop)
        add_kv_control(
            self.server,
            self.engine_id,
            self.layout,
            self.transport,
            self.prefill.connector if self.prefill else None,
        )
        #: Requests admitted and waiting for their first token (the server's loop only).
        self.queued = 0
        service = WorkerServicer(self)
        self.server.add(lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(service, s))
        self.started_at = time.time()
        self.server.start()
        logger.info("%s worker %s serving on %s", config.role, self.engine_id, self.address)

    def stats(self) -> dict:
        """Load, KV headroom and pool integrity, from the snapshot the engine loop publishes
        after every step: never waits for the engine."""
        out = dict(self.loop.snapshot)
        out.update(
            engine_id=self.engine_id,
            role=self.config.role,
            address=self.address,
            model=self.model_name,
            page_size_bytes=self.layout.page_size_bytes,
            block_size=self.layout.block_size,
            cpu_kernels=cpu_kernels.status(build=False),
            tensor_parallel_size=self.layout.tp_size,
        )
        for role in (self.prefill, self.decode):
            if role is not None:
                out.update(role.stats())
        out["transport"] = self.transport.stats()
        return out

    def close(self) -> None:
        self.server.stop(grace=1.0)
        self.loop.stop()
        if self.ranks is not None:
            self.ranks.close(self.engine)
        for role in (self.prefill, self.decode):
            if role is not None:
                role.close()
        self.transport.close()


def _rank_lost(rank: int, code: int) -> None:
    """A worker whose tensor-parallel rank died cannot take another step: it ends at once
    (its other ranks follow it), so that its requests migrate or retry elsewhere and its
    supervisor (Ray, or whoever started it) brings the whole worker back."""
    logger.critical("tensor-parallel rank %d exited (code %s): this worker stops", rank, code)
    logging.shutdown()
    os._exit(70)


def _model_identity(hf_config: dict, model) -> str:
    """Architecture, size and a checksum of the first weights: peers must serve one model."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    params = list(model.parameters())
    # the first parameter (the embedding) is whole on every tensor-parallel rank
    head = params[0].detach().flatten()[:4096].float().cpu().numpy().tobytes()
    digest = hashlib.sha256(head).hexdigest()[:16]
    tp = hf_config.get(TP_CONFIG_KEY)
    n = tp["parameters"] if tp else sum(p.numel() for p in params)
    return json.dumps({"architecture": arch, "parameters": n, "weights": digest}, sort_keys=True)
