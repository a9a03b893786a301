"""`WorkerConfig`: everything one worker process is started with (both roles' settings
included: the role packages read theirs). Built from flags or `serve`'s settings by
`launcher/settings.py` only."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid_pd.connector.prefill import DEFAULT_LEASE_S
from hybrid_pd.engine.engine import EngineConfig
from hybrid_pd.workers import DEFAULT_MAX_QUEUED

#: Roles a worker can take: prefill only, decode only, or both (aggregated).
ROLES = ("prefill", "decode", "both")
#: What a decode worker does when a KV pull fails: prefill the prompt itself, or fail.
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    device: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    secret: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    failure_policy: str = "recompute"  # or "fail"
    transfer_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    #: UCX transports (UCX_TLS syntax, e.g. "tcp,self"); None: UCX's choice.
    ucx_tls: str | None = None
    #: Decode role: pack a pull's runs of blocks into a few scatter-gather UCX messages.
    kv_scatter_gather: bool = True
    max_queued: int = DEFAULT_MAX_QUEUED
    #: Decode role: prefill workers (control addresses) it may pull from at start; the
    #: proxy adds the rest (AddPeers).
    peers: tuple[str, ...] = ()
    #: Ranks of the worker's engine (one process each on this host; this one is rank 0).
    tensor_parallel_size: int = 1
    #: torch threads of each rank > 0 (rank 0: the caller's setting).
    rank_threads: int | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError("failure policy must be 'recompute' or 'fail'")
        if self.lease_s <= 0:
            raise ValueError("lease must be positive")
        if self.max_queued < 1:
            raise ValueError("max_queued must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
