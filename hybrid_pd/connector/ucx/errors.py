"""The errors the UCX data plane raises."""

from __future__ import annotations

from hybrid_pd.connector.base import TransferFailed


class TransferError(TransferFailed):
    """A UCX transfer failed, timed out or was cancelled (a RuntimeError)."""


class Unsettled(TransferError):
    """A cancelled receive that was already being copied did not stop in time."""
