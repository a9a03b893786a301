"""A request's state inside one engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_pd.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    #: Blocks allocated, the prompt's KV is being pulled from a prefill worker.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
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
    #: Draws the generator has made or skipped: one per output token sampled with it, so
    #: it is behind by the tokens sampled elsewhere (engine.sampling.skip_draws).
    draws: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    #: Prefill role: stop after the first token and hand the KV to a decode worker.
    remote_decode: bool = False
    #: Prefill role, overlap: the transfer token a decode worker shows to follow this
    #: request's progress and pull its computed blocks before the prefill ends.
    stage_token: str | None = None
    #: Set when the KV was handed over: what the decode worker needs to pull it.
    kv_transfer_params: dict | None = None
    #: Decode role: where the prompt's KV comes from (opaque to the engine, handed to the
    #: connector's worker side). None once loaded, or when the request computes its prompt.
    remote_kv: Any = None
    #: What to do when that load fails: "recompute" the prompt here, or "fail".
    on_load_failure: str = "recompute"
    #: How the load went (connector.base.LoadResult), and whether it fell back to recompute.
    load_result: Any = None
    recomputed: bool = False
    #: When the params ask for them: one TokenLogprob per output token (None for tokens
    #: sampled elsewhere), and one per prompt token (the first is always None).
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    #: Structured output: the request's grammar matcher (engine.grammar), and how many of
    #: its output tokens the matcher has consumed.
    matcher: Any = None
    matched: int = 0

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

    def append_token(self, token: int, logprob: Any = None) -> None:
        """Add a sampled token (and its TokenLogprob, when asked for) and set
        finish_reason when a stop condition is met."""
        self.all_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= p.max_tokens:
            self.finish_reason = "length"
