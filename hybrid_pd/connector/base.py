"""Connector interfaces, after vLLM's KVConnectorBase_V1 roles.

Scheduler side decides (what to keep, what to load); worker side moves bytes. Here one
object per role does both halves for its worker: `PrefillConnector` keeps finished prefills'
blocks under a lease and serves pulls; `DecodeConnector` pulls them into fresh blocks.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


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


class TransferFailed(RuntimeError):
    """A KV pull did not complete; the message says why."""
