"""A worker: model, KV layout, UCX transport, engine loop and one gRPC server, with the
roles it is given.

    Worker (this package: the plumbing every role shares)
      ├── Role from prefill_worker/: the prefill half of the connector, KVControl, Prefill
      └── Role from decode_worker/:  the decode half, the failure policy, Generate, AddPeers

The plumbing imports no role: a role package builds its worker by passing its factory
(`prefill_worker.build_worker`, `decode_worker.build_worker`; both at once: `hybrid_pd.roles`).
Plain class, testable without Ray; the Ray actor (launcher) is a thin shell over it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence

from hybrid_pd.api.card import ModelCard
from hybrid_pd.connector.base import KVConnector
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.segments import PoolRegions
from hybrid_pd.connector.setup import add_kv_control, open_server, start_transport
from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.engine import Engine, plan_kv_caches
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.engine.tiny import resolve_model
from hybrid_pd.engine.tp.group import SINGLE
from hybrid_pd.kvcache.ids import EngineId
from hybrid_pd.proto import worker_pb2_grpc
from hybrid_pd.workers.config import ROLES, WorkerConfig
from hybrid_pd.workers.identity import model_identity
from hybrid_pd.workers.role import Role, WorkerParts
from hybrid_pd.workers.service import WorkerServicer
from hybrid_pd.workers.tp_ranks import RankGroup

__all__ = ["ROLES", "RoleFactory", "Worker", "WorkerConfig"]

logger = logging.getLogger(__name__)

#: Makes a role once the worker's parts exist (its engine does not yet).
RoleFactory = Callable[[WorkerParts], Role]


class Worker:
    def __init__(self, config: WorkerConfig, roles: Sequence[RoleFactory]) -> None:
        """Load the model, open the transport and the server, make the `roles`, build the
        engine with their connector halves and serve. At most one role brings each half."""
        self.config = config
        self.engine_id = EngineId(f"{config.role}-{uuid.uuid4().hex[:10]}")
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
        kv_config, whole, _ = plan_kv_caches(model, hf_config, config.engine)
        identity = model_identity(hf_config, model)
        self.layout = KVLayout.of(kv_config, identity.key(), whole, tp.size)
        #: Every rank's pool in rank order (rank 0's alone without tensor parallelism).
        self.pools: list = []
        self.transport = start_transport(config.host, config.ucx_tls)
        self.server, self.address = open_server(config.host, config.port, config.secret)
        self.port = self.server.port

        parts = WorkerParts(
            config=config,
            engine_id=self.engine_id,
            layout=self.layout,
            address=self.address,
            transport=self.transport,
            region=PoolRegions(lambda: self.engine.pool.buffer),  # the pool, once it exists
            shard_buffers=lambda: self.pools,
        )
        self.roles: list[Role] = [make(parts) for make in roles]
        connector = KVConnector(
            scheduler=_one(r.scheduler_half for r in self.roles),
            worker=_one(r.worker_half for r in self.roles),
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
        for role in self.roles:
            role.attach(self.loop)
            role.mount(self.server)
        if not any(r.serves_kv_control for r in self.roles):  # the handshake alone
            add_kv_control(self.server, self.engine_id, self.layout, self.transport, None)
        #: Requests admitted and waiting for their first token (the server's loop only).
        self.queued = 0
        rpcs: dict = {}
        for role in self.roles:
            rpcs.update(role.rpcs(self))
        service = WorkerServicer(self, rpcs)
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
        for role in self.roles:
            out.update(role.stats())
        out["transport"] = self.transport.stats()
        return out

    def close(self) -> None:
        self.server.stop(grace=1.0)
        self.loop.stop()
        if self.ranks is not None:
            self.ranks.close(self.engine)
        for role in self.roles:
            role.close()
        self.transport.close()


def _one(halves):
    """The one connector half the roles bring of a kind, or None."""
    given = [h for h in halves if h is not None]
    if len(given) > 1:
        raise ValueError("two roles bring the same half of the connector")
    return given[0] if given else None


def _rank_lost(rank: int, code: int) -> None:
    """A worker whose tensor-parallel rank died cannot take another step: it ends at once
    (its other ranks follow it), so that its requests migrate or retry elsewhere and its
    supervisor (Ray, or whoever started it) brings the whole worker back."""
    logger.critical("tensor-parallel rank %d exited (code %s): this worker stops", rank, code)
    logging.shutdown()
    os._exit(70)
