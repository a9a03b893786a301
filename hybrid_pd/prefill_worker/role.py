"""PrefillRole: what a worker adds to its engine to serve prefills for decode workers.

Prefill RPC ──► engine (remote_decode: stop after the first token)
            ──► PrefillConnector.request_finished_all_groups: lease the blocks
KVControl PullKV / Release / Heartbeat / Abort ──► PrefillConnector
lease released or expired ──► the engine loop frees the blocks (posted, never awaited)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.prefill import PrefillConnector
from hybrid_pd.engine.loop import EngineLoop


class PrefillRole:
    def __init__(
        self,
        *,
        engine_id: str,
        layout: KVLayout,
        control_address: str,
        transport,
        region: Callable[[int, int], object],
        lease_s: float,
        shard_buffers: Callable[[], Sequence] | None = None,
    ) -> None:
        self._loop: EngineLoop | None = None
        self.connector = PrefillConnector(
            engine_id=engine_id,
            layout=layout,
            control_address=control_address,
            free_blocks=self._free_kept,
            region=region,
            transport=transport,
            lease_s=lease_s,
            shard_buffers=shard_buffers,
        )

    def attach(self, loop: EngineLoop) -> None:
        """The engine loop exists: frees go to it, leases expire on its idle ticks."""
        self._loop = loop
        loop.add_hook(self.connector.expire)

    def _free_kept(self, request_id: str) -> None:
        # Called from RPC handlers and the expiry hook: post, never wait for a step.
        self._loop.post(self._loop.engine.free_request_blocks, request_id)

    def abort(self, request_id: str) -> bool:
        """Drop a kept request (the proxy's Abort; the control plane is authenticated)."""
        return self.connector.abort_request(request_id)

    def abort_with_token(self, request_id: str, token: str) -> bool:
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
