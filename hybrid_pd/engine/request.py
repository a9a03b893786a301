"""A request's state inside one engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from hybrid_pd.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    #: prompt + output tokens; the KV cache manager keeps a reference to this list.
    all_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    #: Prefill role: stop after the first token and hand the KV to a decode worker.
    remote_decode: bool = False
    #: Set when the KV was handed over: what the decode worker needs to pull it.
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if not self.all_ids:
            self.all_ids = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[len(self.prompt_ids) :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.all_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token: int) -> None:
        """Add a sampled token and set finish_reason when a stop condition is met."""
        self.all_ids.append(token)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= p.max_tokens:
            self.finish_reason = "length"
