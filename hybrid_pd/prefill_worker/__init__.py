"""The prefill role: engine + the prefill half of the connector + the KVControl service."""

from hybrid_pd.prefill_worker.role import PrefillRole

__all__ = ["PrefillRole"]
