"""`serve`'s settings: `ServeConfig` (flags, YAML keys, validation) and where the
control-plane secret comes from. No torch and no Ray here: the CLI reads and checks the
settings before it starts anything."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_pd.api.secret import SECRET_ENV, given_secret
from hybrid_pd.api.sizes import held_state_rows_bytes, parse_bytes
from hybrid_pd.launcher.console import level_of
from hybrid_pd.workers import DEFAULT_MAX_QUEUED

if TYPE_CHECKING:
    from hybrid_pd.workers.config import WorkerConfig

logger = logging.getLogger(__name__)

#: Tensor-parallel sizes the overlapped hand-over was verified with, on either side and in
#: any pair (its staged pulls plan rank pieces exactly as the ordinary pull does).
OVERLAP_TP_SIZES = (1, 2, 4)


def resolve_secret(
    secret: str | None,
    secret_file: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    embedded: bool,
    insecure: bool = False,
) -> str | None:
    """The control-plane secret of a deployment. Precedence: `secret`, `secret_file` (its
    contents, stripped), the HYBRID_PD_SECRET environment variable; then, with none of those,
    a fresh random one in embedded mode, and in cluster mode a refusal (ValueError) unless
    `insecure`, which runs the workers open (None)."""
    given = given_secret(secret, secret_file, dict(os.environ if environ is None else environ))
    if given is not None:
        return given
    if embedded:
        return secrets.token_urlsafe(32)
    if insecure:
        logger.warning("joining a Ray cluster WITHOUT a control-plane secret (--insecure)")
        return None
    raise ValueError(
        "joining a Ray cluster (--address) needs a control-plane secret: give --secret-file "
        f"PATH or set {SECRET_ENV} (or pass --insecure to run the worker RPCs open)"
    )


#: Engines `serve` can run its workers on.
ENGINES = ("hybrid-pd", "vllm")
#: Where a Python with vLLM is found when `vllm_python` is not set.
VLLM_PYTHON_ENV = "HYBRID_PD_VLLM_PYTHON"


@dataclass(frozen=True)
class ServeConfig:
    model: str = "tiny"
    #: Ids clients pass as `model` (the first is listed); empty: `tiny`, or a checkpoint
    #: folder's last component (the folder as given is accepted too).
    served_model_names: tuple[str, ...] = ()
    prefill: int = 1
    decode: int = 1
    address: str | None = None  # Ray cluster; None: embedded local Ray
    host: str = "127.0.0.1"  # proxy
    port: int = 8000
    kv_memory: str = "1GiB"
    #: Per worker: memory for decode rows' states kept between steps (EngineConfig.
    #: held_state_rows_bytes; bytes or "256MiB"; "0" turns it off); None: the engine's default.
    held_state_rows: str | int | None = None
    #: The control-plane secret; see `resolve_secret` for where else it comes from.
    secret: str | None = None
    #: A file holding the secret (read when `secret` is not set).
    secret_file: str | None = None
    #: Allow joining a cluster with no secret at all (worker RPCs open to the network).
    insecure: bool = False
    device: str | None = None
    failure_policy: str = "recompute"
    min_prefill_tokens: int = 32
    lease_s: float = 30.0
    #: Ray restarts of one worker actor (same actor, new process).
    max_restarts: int = 3
    #: Fresh actors made for one worker slot once Ray cannot bring its actor back.
    max_recreates: int = 2
    #: How long a worker may stay unreachable (restarting, pending, starting) before it
    #: counts as lost; covers loading the model on a fresh actor.
    restore_timeout_s: float = 300.0
    threads: int | None = None
    #: Where workers serve gRPC: "auto" = the Ray node's address (clusters), else a host.
    worker_host: str | None = None
    #: UCX transports for KV transfers (UCX_TLS syntax); None: UCX's choice.
    ucx_tls: str | None = None
    #: Backpressure and failure handling (see docs/architecture.md, "Under load and faults").
    #: Per worker: requests admitted and waiting for their first token (then 429 upstream).
    max_queued: int = DEFAULT_MAX_QUEUED
    #: Proxy: requests held at once; how long one may wait for a worker with room.
    max_pending: int = 1024
    queue_timeout_s: float = 30.0
    #: Proxy: prefills run on decode workers at once while no prefill worker is up.
    max_fallback_prefills: int = 4
    #: Proxy: how often one stream may move to another decode worker after a failure.
    max_migrations: int = 3
    #: Proxy: "prefix" (KV-aware routing) or "load"; see ProxyConfig.kv_routing.
    kv_routing: str = "prefix"
    #: Proxy: overlap the KV hand-over with prefill; see ProxyConfig.overlap_transfer.
    overlap_transfer: bool = False
    #: Logging of the launcher, the proxy (its access log included) and the workers:
    #: debug, info, warning or error.
    log_level: str = "info"
    #: The engine of the workers: "hybrid-pd" (ours) or "vllm" (vLLM OpenAI servers running
    #: hybrid-pd's connector, each behind our Worker API).
    engine: str = "hybrid-pd"
    #: engine vllm: a Python that has vLLM (None: $HYBRID_PD_VLLM_PYTHON, else this one).
    vllm_python: str | None = None
    #: engine vllm: the compute dtype (None: the checkpoint's, else float32).
    dtype: str | None = None
    #: Ranks of each worker's engine (tensor parallelism), one process each, all on the
    #: worker's node; per role when set there.
    tensor_parallel_size: int = 1
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        names = self.served_model_names
        names = (names,) if isinstance(names, str) else tuple(names or ())
        if any(not isinstance(n, str) or not n.strip() for n in names):
            raise ValueError(f"served model names must be non-empty strings, got {names!r}")
        object.__setattr__(self, "served_model_names", names)
        for name in ("max_queued", "max_pending"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_fallback_prefills < 0 or self.max_migrations < 0:
            raise ValueError("max_fallback_prefills and max_migrations must be >= 0")
        if self.kv_routing not in ("prefix", "load"):
            raise ValueError(f"kv_routing must be 'prefix' or 'load', got {self.kv_routing!r}")
        if self.overlap_transfer and self.engine == "vllm":
            raise ValueError("overlap_transfer applies to engine hybrid-pd only")
        if self.queue_timeout_s <= 0:
            raise ValueError("queue_timeout_s must be > 0")
        if self.prefill < 0 or self.decode < 1:
            raise ValueError("serve needs at least one decode worker (--decode >= 1)")
        parse_bytes(self.kv_memory)  # validates
        if self.held_state_rows is not None:
            if self.engine == "vllm":
                raise ValueError("held_state_rows applies to engine hybrid-pd only")
            held_state_rows_bytes(self.held_state_rows)  # validates
        if self.failure_policy not in ("recompute", "fail"):
            raise ValueError("failure_policy must be 'recompute' or 'fail'")
        if self.max_restarts < 0 or self.max_recreates < 0:
            raise ValueError("max_restarts and max_recreates must be >= 0")
        if self.restore_timeout_s <= 0:
            raise ValueError("restore_timeout_s must be > 0")
        if not isinstance(self.insecure, bool):
            raise ValueError("insecure must be true or false")
        level_of(self.log_level)  # validates
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        for role in ("prefill", "decode"):
            if self.tp_size(role) < 1:
                raise ValueError(f"{role} tensor-parallel size must be >= 1")
        sizes = (self.tp_size("prefill"), self.tp_size("decode"))
        if self.overlap_transfer and any(n not in OVERLAP_TP_SIZES for n in sizes):
            raise ValueError(
                "overlap_transfer is verified with tensor-parallel sizes 1, 2 and 4 only "
                f"(prefill {sizes[0]}, decode {sizes[1]}): turn it off or use one of those"
            )
        if self.engine == "vllm" and self.model == "tiny":
            raise ValueError(
                "engine vllm serves a checkpoint folder: give --model PATH (vLLM's CPU "
                "attention needs head_dim 64 or 128, which the built-in model lacks)"
            )

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> ServeConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def resolved(self, environ: Mapping[str, str] | None = None) -> ServeConfig:
        """This config with its secret settled (`secret` set, `secret_file` cleared): see
        `resolve_secret`. Raises ValueError where a cluster would be joined without one."""
        secret = resolve_secret(
            self.secret,
            self.secret_file,
            environ,
            embedded=self.address is None,
            insecure=self.insecure,
        )
        return dataclasses.replace(self, secret=secret, secret_file=None)

    def tp_size(self, role: str) -> int:
        """Ranks of a `role` worker ("prefill" or "decode")."""
        own = getattr(self, f"{role}_tensor_parallel_size")
        return self.tensor_parallel_size if own is None else own

    @property
    def engine_processes(self) -> int:
        """Engine processes of every worker together (what shares an embedded host)."""
        return self.prefill * self.tp_size("prefill") + self.decode * self.tp_size("decode")

    def worker_config(self, role: str, model_path: str) -> WorkerConfig:
        from hybrid_pd.workers.settings import worker_config

        host = self.worker_host or ("127.0.0.1" if self.address is None else "auto")
        return worker_config(
            role, model_path, self, host=host, tensor_parallel_size=self.tp_size(role)
        )

    def resolved_vllm_python(self) -> str:
        import sys

        return self.vllm_python or os.environ.get(VLLM_PYTHON_ENV) or sys.executable

    def __repr__(self) -> str:  # never print the secret
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        if shown["secret"] is not None:
            shown["secret"] = "***"
        return "ServeConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"
