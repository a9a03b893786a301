"""PrefillRole: what a worker adds to its engine to serve prefills for decode workers.

Prefill RPC (service.py) ──► engine (remote_decode: stop after the first token)
            ──► PrefillConnector.request_finished_all_groups: lease the blocks
KVControl PullKV / Release / Heartbeat / Abort / Progress ──► PrefillConnector
lease released or expired ──► the engine loop frees the blocks (posted, never awaited)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.control import AioServer
from hybrid_pd.connector.prefill import PrefillConnector
from hybrid_pd.connector.setup import add_kv_control
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.kvcache.ids import RequestId
from hybrid_pd.workers.role import Handler, Role, WorkerParts

if TYPE_CHECKING:
    from hybrid_pd.workers.worker import Worker


class PrefillRole(Role):
    serves_kv_control = True

    def __init__(self, parts: WorkerParts) -> None:
        self._parts = parts
        self._loop: EngineLoop | None = None
        self.connector = PrefillConnector(
            **parts.connector_parts(),
            control_address=parts.address,
            free_blocks=self._free_kept,
            lease_s=parts.config.lease_s,
            secret=parts.config.secret,
        )
        self.scheduler_half = self.connector

    def attach(self, loop: EngineLoop) -> None:
        """The engine loop exists: frees go to it, leases expire on its idle ticks."""
        self._loop = loop
        loop.add_hook(self.connector.expire)

    def mount(self, server: AioServer) -> None:
        """KVControl: the handshake, and pulls / releases / heartbeats of the kept KV."""
        p = self._parts
        add_kv_control(server, p.engine_id, p.layout, p.transport, self.connector)

    def rpcs(self, worker: Worker) -> dict[str, Handler]:
        from hybrid_pd.prefill_worker.service import PrefillService

        return {"Prefill": PrefillService(worker).Prefill}

    def _free_kept(self, request_id: RequestId) -> None:
        # Called from RPC handlers and the expiry hook: post, never wait for a step.
        self._loop.post(self._loop.engine.free_request_blocks, request_id)

    def abort(self, request_id: RequestId) -> bool:
        """Drop a kept request (the proxy's Abort; the control plane is authenticated)."""
        return self.connector.abort_request(request_id)

    def abort_with_token(self, request_id: RequestId, token: str) -> bool:
        """Drop a kept request for a caller that shows its transfer token."""
        try:
            self.connector.release(request_id, token, reason="aborted")
        except TransferFailed:
            return False
        return True

    def stats(self) -> dict:
        return {
            "leases": self.connector.num_leases,
            "prefill_connector": self.connector.stats_snapshot(),
        }

    def close(self) -> None:
        self.connector.close()
