"""DecodeRole: what a worker adds to its engine to continue requests prefilled elsewhere.

Generate(kv_transfer_params) (service.py) ──► engine queue (remote_kv: waits for blocks)
scheduler allocates the blocks ──► DecodeConnector.start_load_kv (pull on its threads)
pull ends ──► loop.wake ──► scheduler: run from prompt + first token, or apply the
                            failure policy (recompute here, or fail the request)
requests still waiting for blocks ──► heartbeats keep their prefill leases alive
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hybrid_pd.api.params import KVTransferParams, prompt_digest
from hybrid_pd.connector.decode import DecodeConnector
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.kvcache.ids import RequestId
from hybrid_pd.workers.config import FAILURE_POLICIES
from hybrid_pd.workers.role import Handler, Role, WorkerParts

if TYPE_CHECKING:
    from hybrid_pd.workers.worker import Worker

#: While a request waits for blocks, its prefill lease is extended this often.
HEARTBEAT_S = 5.0
POLICIES = FAILURE_POLICIES


class DecodeRole(Role):
    def __init__(self, parts: WorkerParts) -> None:
        config = parts.config
        if config.failure_policy not in POLICIES:
            raise ValueError(f"failure policy must be one of {POLICIES}")
        self.failure_policy = config.failure_policy
        self._loop: EngineLoop | None = None
        self._next_beat = 0.0
        self.connector = DecodeConnector(
            **parts.connector_parts(),
            secret=config.secret,
            timeout_s=config.transfer_timeout_s,
            peers=tuple(config.peers),
            scatter_gather=config.kv_scatter_gather,
        )
        self.worker_half = self.connector

    def attach(self, loop: EngineLoop) -> None:
        self._loop = loop
        self.connector.notify = loop.wake
        loop.add_hook(self._keep_leases)

    def rpcs(self, worker: Worker) -> dict[str, Handler]:
        from hybrid_pd.decode_worker.service import DecodeService

        service = DecodeService(worker, self)
        return {"Generate": service.Generate, "AddPeers": service.AddPeers}

    def request_kwargs(
        self, kv: KVTransferParams, prompt_ids: list[int], policy: str = ""
    ) -> tuple[RequestId, dict]:
        """Engine.add_request keywords for a request whose KV waits on a prefill worker
        (`kv` already validated: `KVTransferParams.from_pb`); returns (the prefill-side
        request id, kwargs). Raises ValueError when `kv` or `policy` do not fit."""
        if kv.prompt_len != len(prompt_ids):
            raise ValueError(
                f"kv_transfer_params.prompt_len is {kv.prompt_len} but the prompt "
                f"has {len(prompt_ids)} tokens"
            )
        if kv.prompt_digest and kv.prompt_digest != prompt_digest(prompt_ids):
            raise ValueError("kv_transfer_params were made for another prompt (digest differs)")
        policy = policy or self.failure_policy
        if policy not in POLICIES:
            raise ValueError(f"failure_policy must be one of {POLICIES}")
        first = [] if kv.staged else [kv.first_token]  # staged: the load brings it
        kwargs = {"output_ids": first, "remote_kv": kv, "on_load_failure": policy}
        return kv.request_id, kwargs

    def dropped(self, request) -> None:
        """An aborted request whose KV was never pulled: let the prefill worker free it."""
        if request is not None and request.remote_kv is not None:
            self.connector.abort_later(request.remote_kv)

    def _keep_leases(self) -> None:
        """Engine thread, idle tick: heartbeats for requests whose KV is not pulled yet."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + HEARTBEAT_S
        sched = self._loop.engine.scheduler
        pending = [r.remote_kv for r in sched.waiting if r.remote_kv is not None]
        self.connector.keep_alive(pending)

    def stats(self) -> dict:
        return {
            "decode_connector": self.connector.stats_snapshot(),
            "peers": self.connector.known_peers,
        }

    def close(self) -> None:
        self.connector.close()
