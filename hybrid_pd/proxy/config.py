"""ProxyConfig: everything the OpenAI-compatible front door needs, validated once."""

from __future__ import annotations

from dataclasses import dataclass

KV_ROUTING = ("prefix", "load")


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    #: Ids clients may pass as `model` (the first is the one listed); empty: the workers'
    #: model (`tiny`, or a checkpoint folder's last component, or the folder as given).
    served_model_names: tuple[str, ...] = ()
    #: Folder of tokenizer.json on this host; None: the folder the workers report.
    model_path: str | None = None
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    secret: str | None = None
    #: Prompts shorter than this skip the prefill pool and run wholly on a decode worker.
    min_prefill_tokens: int = 32
    #: A lower limit than the workers' own (None: theirs).
    max_model_len: int | None = None
    #: Chat requests without max_tokens get at most this many tokens.
    default_chat_max_tokens: int = 256
    #: Prefill RPC deadline.
    prefill_timeout_s: float = 120.0
    #: Deadline of a whole decode stream.
    request_timeout_s: float = 600.0
    #: Longest silence tolerated between two chunks of a decode stream.
    stream_idle_timeout_s: float = 60.0
    #: Deadline of Stats and Abort calls.
    control_timeout_s: float = 2.0
    #: Worker stats are refreshed at most this often when picking a decode worker.
    stats_interval_ms: int = 500
    #: Decode's reaction to a failed KV pull ("recompute" or "fail"); "" = the worker's own.
    failure_policy: str = ""
    #: Requests the proxy holds at once (waiting for a worker with room, or running);
    #: past this a new request gets 429 at once.
    max_pending_requests: int = 1024
    #: How long a request may be held waiting for a worker with room (every queue full)
    #: or for a live worker (all down, restarting) before 429 / 503.
    queue_timeout_s: float = 30.0
    #: Prefills run on decode workers at once when no prefill worker is up (beyond this
    #: they wait for a prefill worker or a fallback slot).
    max_fallback_prefills: int = 4
    #: How often one request's decode stream may move to another worker after its worker
    #: failed (Dynamo-style request migration: prompt + tokens already produced).
    max_migrations: int = 3
    #: A worker whose health checks fail (other than connection refused, which counts at
    #: once) is treated as dead only after failing for this long: busy is not dead.
    dead_after_s: float = 10.0
    #: How a request's workers are picked. "prefix" (KV-aware): by a cost in tokens, those
    #: of the request the worker was never sent (its prefix cache lacks them) plus its load
    #: (prefill: prompt tokens queued on it; decode: `kv_routing_load_weight` times the
    #: request's tokens per stream it runs), among workers at most
    #: `kv_routing_max_imbalance` requests busier than the least loaded: a conversation's
    #: next turn goes where its last one ran unless that worker is clearly busier. "load":
    #: the least loaded only.
    kv_routing: str = "prefix"
    kv_routing_max_imbalance: int = 4
    kv_routing_load_weight: float = 0.5
    #: Overlap the KV hand-over with prefill: the decode leg starts beside the Prefill and
    #: pulls attention blocks as their chunks finish (our engine's workers only).
    overlap_transfer: bool = False

    def __post_init__(self) -> None:
        for name in ("prefill_addresses", "decode_addresses"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            value = tuple(value)
            for addr in value:
                _check_address(name, addr)
            object.__setattr__(self, name, value)
        if not isinstance(self.host, str) or not self.host:
            raise ValueError("host must be a non-empty string")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        names = self.served_model_names
        names = (names,) if isinstance(names, str) else tuple(names)
        if any(not isinstance(n, str) or not n.strip() for n in names):
            raise ValueError(f"served model names must be non-empty strings, got {names!r}")
        object.__setattr__(self, "served_model_names", tuple(dict.fromkeys(names)))
        if self.model_path is not None:
            object.__setattr__(self, "model_path", str(self.model_path))
        if not isinstance(self.min_prefill_tokens, int) or self.min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {self.min_prefill_tokens!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not isinstance(self.default_chat_max_tokens, int) or self.default_chat_max_tokens < 1:
            raise ValueError("default_chat_max_tokens must be an integer >= 1")
        for name in ("max_pending_requests", "max_fallback_prefills", "max_migrations"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_pending_requests < 1:
            raise ValueError("max_pending_requests must be at least 1")
        for name in (
            "prefill_timeout_s",
            "request_timeout_s",
            "stream_idle_timeout_s",
            "control_timeout_s",
            "queue_timeout_s",
            "dead_after_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.stats_interval_ms, int) or self.stats_interval_ms < 0:
            raise ValueError(f"stats_interval_ms must be >= 0, got {self.stats_interval_ms!r}")
        if self.kv_routing not in KV_ROUTING:
            raise ValueError(f"kv_routing must be one of {KV_ROUTING}, got {self.kv_routing!r}")
        value = self.kv_routing_max_imbalance
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"kv_routing_max_imbalance must be an integer >= 0, got {value!r}")
        weight = self.kv_routing_load_weight
        if not isinstance(weight, int | float) or isinstance(weight, bool) or weight < 0:
            raise ValueError(f"kv_routing_load_weight must be a number >= 0, got {weight!r}")
        if self.failure_policy not in ("", "recompute", "fail"):
            raise ValueError("failure_policy must be '', 'recompute' or 'fail'")


def _check_address(field: str, addr: object) -> None:
    if not isinstance(addr, str) or ":" not in addr:
        raise ValueError(f"{field}: expected 'host:port', got {addr!r}")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{field}: expected 'host:port', got {addr!r}")
