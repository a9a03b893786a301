"""Connector interfaces, after vLLM's KVConnectorBase_V1 split.

    engine scheduler ──► ConnectorScheduler   decides: keep a finished prefill's blocks
                                              (request_finished_all_groups)
    engine step      ──► ConnectorWorker      moves bytes: start_load_kv (asynchronous),
                                              get_finished between steps

The engine receives one `KVConnector` at construction and knows the connector only through
these two protocols; which halves are present depends on the worker's role.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybrid_pd.kvcache.ids import RequestId


@runtime_checkable
class SupportsHMA(Protocol):
    """A connector that understands the hybrid manager's per-group block ids."""

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """Called when a request's prefill is done (out-of-window blocks already released).

        `block_ids[g]` are group g's block ids (0 = null block). Returns (delay_free,
        kv_transfer_params): delay_free=True means the connector now owns the blocks and
        frees them later; the dict (JSON-able) tells a decode worker how to pull them.
        """
        ...


ConnectorScheduler = SupportsHMA


@dataclass(frozen=True)
class LoadResult:
    """How one asynchronous load ended. `error` is None on success."""

    request_id: RequestId
    error: str | None = None
    bytes: int = 0
    messages: int = 0
    seconds: float = 0.0
    #: Staged loads (the prefill still ran when the load began): the prefill's first token
    #: once known (None: never learned), and of `bytes` those moved while it ran.
    first_token: int | None = None
    staged_bytes: int = 0


@runtime_checkable
class ConnectorWorker(Protocol):
    """Moves a request's KV into blocks the scheduler reserved for it."""

    def start_load_kv(
        self,
        request_id: RequestId,
        params: Any,
        block_ids: tuple[list[int], ...],
        held: Sequence[int] = (),
    ) -> None:
        """Begin filling `block_ids` (per group, null blocks included) with the KV that
        `params` describes. Returns at once; the outcome is reported by `get_finished`.
        The blocks must stay allocated until then, whatever happens to the request.
        `held[g]`: group g's first non-null blocks already hold their KV (this worker's
        prefix cache); they are not loaded. Empty: load every block."""
        ...

    def get_finished(self) -> Sequence[LoadResult]:
        """Loads that ended since the last call (each reported exactly once)."""
        ...

    def has_finished(self) -> bool:
        """Whether `get_finished` has something to report (cheap, any thread)."""
        ...

    def keep_alive(self, params: Sequence[Any]) -> None:
        """Requests still waiting for blocks: keep their KV alive at the source (best
        effort, asynchronous)."""
        ...


@dataclass(frozen=True)
class KVConnector:
    """The halves an engine uses: `scheduler` on prefill workers (keeps finished
    prefills' KV for a decode worker), `worker` on decode workers (pulls it)."""

    scheduler: ConnectorScheduler | None = None
    worker: ConnectorWorker | None = None


class TransferFailed(RuntimeError):
    """A KV pull did not complete; the message says why."""
