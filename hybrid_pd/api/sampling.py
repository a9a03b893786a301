"""Sampling parameters: how to pick tokens, checked once on construction (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid_pd.api.constraint import Constraint

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
#: Most alternatives a request may ask for per token (OpenAI's chat bound).
MAX_TOP_LOGPROBS = 20
#: Temperatures below this sample greedily (and are stored as 0). Logits divided by a
#: temperature such as 1e-40 overflow float32 to inf, which failed the step; at 1e-5 a logit
#: gap of 1e-3 already leaves the runner-up e^-100 of the top token's probability.
MIN_TEMPERATURE = 1e-5
#: A smaller top_p (e.g. 1e-310, a subnormal) is raised to this one: both keep only the top
#: token, and engine processes, which flush subnormals to zero (hybrid_pd/engine/threads.py),
#: would read a subnormal as 0 and refuse it.
MIN_TOP_P = 1e-30


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model's raw distribution (before temperature,
    top-k or top-p), and the `top` most likely tokens at that position, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 (or below MIN_TEMPERATURE) means greedy.
    Validated on construction."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: Log-probabilities of each output token, with this many alternatives (None: off).
    logprobs: int | None = None
    #: Log-probabilities of each prompt token after the first, with this many alternatives
    #: (None: off). Such a request computes its whole prompt (no prefix cache hit).
    prompt_logprobs: int | None = None
    #: What the output must match (structured output), or None: unconstrained.
    constraint: Constraint | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # Bounds are the wire's (int32 / int64 fields): past them a value cannot travel.
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(
                f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}"
            )
        if not isinstance(self.top_k, int) or self.top_k > INT32_MAX:
            raise ValueError(f"top_k must be an integer <= {INT32_MAX}, got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not 0 <= self.seed <= INT64_MAX
        ):
            raise ValueError(f"seed must be an integer in [0, {INT64_MAX}], got {self.seed!r}")
        if any(not 0 <= int(t) <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {INT64_MAX}]")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS
            ):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}"
                )
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError("constraint must be a Constraint")
        if float(self.temperature) < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if float(self.top_p) < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
