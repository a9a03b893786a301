"""Flags -> engine and worker configuration, in one place.

Every caller that turns operator settings (command-line flags, `serve`'s YAML keys) into
an `EngineConfig` or a `WorkerConfig` goes through here: `hybrid-pd generate`, `serve`
(`ServeConfig.worker_config`) and the worker process (`python -m hybrid_pd.workers.main`).
Sizes arrive as an operator writes them ("1GiB", 268435456) and are read by `api.sizes`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from hybrid_pd.api.sizes import held_state_rows_bytes, parse_bytes
from hybrid_pd.engine.engine import EngineConfig
from hybrid_pd.workers.config import WorkerConfig

_DEFAULT = EngineConfig()


@dataclass(frozen=True)
class EngineSettings:
    """An engine's settings as given (sizes as text or bytes); `config()` reads them."""

    kv_memory: str | int = "256MiB"
    #: None: the engine's default (a quarter of the KV memory, at most 1 GiB).
    held_state_rows: str | int | None = None
    block_size: int | None = None
    max_num_seqs: int = _DEFAULT.max_num_seqs
    max_num_batched_tokens: int = _DEFAULT.max_num_batched_tokens
    reuse_prefix_on_load: bool = _DEFAULT.reuse_prefix_on_load

    @classmethod
    def of(cls, source: object) -> EngineSettings:
        """The settings `source` carries (parsed flags, a `ServeConfig`): each field it has
        under the same name, the default for the others (a command without
        --block-size, say)."""
        given = {f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}
        return cls(**given)

    def config(self) -> EngineConfig:
        """The `EngineConfig`; ValueError names a size that cannot be read."""
        return EngineConfig(
            kv_memory_bytes=parse_bytes(self.kv_memory),
            held_state_rows_bytes=held_state_rows_bytes(self.held_state_rows),
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            reuse_prefix_on_load=self.reuse_prefix_on_load,
        )


#: The `WorkerConfig` fields every source of settings (the worker process's parsed flags,
#: `ServeConfig`) holds under the same name and meaning; its `threads` are the ranks'.
_SAME_NAMED = ("device", "secret", "lease_s", "failure_policy", "ucx_tls", "max_queued")


def worker_config(role: str, model: str, source: object, **given: Any) -> WorkerConfig:
    """A `role` worker of `model` with the settings `source` carries (its `EngineSettings`,
    the `_SAME_NAMED` fields, `threads` for each rank); `given`: the other `WorkerConfig`
    fields (host, port, ...) and those the source names or means otherwise, which win."""
    fields_of_source = {name: getattr(source, name) for name in (*_SAME_NAMED, "threads")}
    fields_of_source["rank_threads"] = fields_of_source.pop("threads")
    engine = EngineSettings.of(source).config()
    return WorkerConfig(role=role, model=model, engine=engine, **{**fields_of_source, **given})


def worker_config_from_args(args: argparse.Namespace, secret: str | None) -> WorkerConfig:
    """The worker process's flags (`workers.main.parse_args`) with its secret, as resolved."""
    return worker_config(
        args.role,
        args.model,
        args,
        host=args.host,
        port=args.port,
        secret=secret,
        transfer_timeout_s=args.transfer_timeout_s,
        kv_scatter_gather=args.kv_scatter_gather,
        peers=tuple(args.peer),
        tensor_parallel_size=args.tensor_parallel_size,
    )
