"""What a role adds to the shared worker, and what the worker gives it.

A role package (`prefill_worker/`, `decode_worker/`) subclasses `Role` and is handed to
`Worker` as a factory `(WorkerParts) -> Role`; the worker calls it once its model, layout,
transport and server exist and before its engine does (the engine takes the roles'
connector halves). The plumbing then calls the hooks below; it never imports a role.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_pd.connector.control import AioServer
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.kvcache.ids import EngineId, RequestId
from hybrid_pd.workers.config import WorkerConfig

if TYPE_CHECKING:
    from hybrid_pd.workers.worker import Worker


@dataclass(frozen=True)
class WorkerParts:
    """What exists when the roles are made (the engine does not yet)."""

    config: WorkerConfig
    engine_id: EngineId
    layout: KVLayout
    #: The worker's gRPC address (its KVControl address for peers).
    address: str
    transport: Any  # UcxTransport
    #: (offset, length) -> a region of the engine's pool, once the pool exists.
    region: Callable[[int, int], object]
    #: Every rank's pool in rank order, once they exist.
    shard_buffers: Callable[[], Sequence]

    def connector_parts(self) -> dict[str, Any]:
        """What either connector half takes from the worker (its engine id, layout,
        transport, pool region and rank pools), as keyword arguments."""
        return {
            "engine_id": self.engine_id,
            "layout": self.layout,
            "transport": self.transport,
            "region": self.region,
            "shard_buffers": self.shard_buffers,
        }


#: An RPC handler of the Worker service: (request, context) -> reply, or an async
#: generator of replies for a streaming RPC.
Handler = Callable[..., Any]


class Role:
    """A role's hooks into the worker; each default does nothing."""

    #: The engine's connector halves this role brings (`connector.base.KVConnector`).
    scheduler_half: Any = None
    worker_half: Any = None
    #: Whether `mount` adds the KVControl service (else the worker mounts the handshake).
    serves_kv_control: bool = False

    def attach(self, loop: EngineLoop) -> None:
        """The engine loop exists (it is not serving yet)."""

    def mount(self, server: AioServer) -> None:
        """Add this role's services to the worker's server (before it starts)."""

    def rpcs(self, worker: Worker) -> dict[str, Handler]:
        """Handlers of the Worker service's role RPCs this role answers, by name."""
        return {}

    def abort(self, request_id: RequestId) -> bool:
        """Drop what this role holds of `request_id` (the proxy's Abort); True if it held
        anything."""
        return False

    def abort_with_token(self, request_id: RequestId, token: str) -> bool:
        """Drop what this role holds of `request_id` for a caller that shows its transfer
        token (a worker without a secret)."""
        return False

    def dropped(self, request: Any) -> None:
        """The engine dropped `request` (an abort, or its caller left)."""

    def stats(self) -> dict:
        """Keys this role adds to `Worker.stats()`."""
        return {}

    def close(self) -> None:
        """The worker closes: release what the role holds."""
