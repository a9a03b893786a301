"""The decode role: engine + the decode half of the connector + the failure policy."""

from hybrid_pd.decode_worker.role import DecodeRole

__all__ = ["DecodeRole"]
