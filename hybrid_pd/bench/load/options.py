"""The options of `hybrid-pd bench load`: its modes and scenarios, the counts of a full run and
of a quick one, and the checked settings a run works from (its child in the network namespace
gets them as JSON)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields

MODES = ("pd", "aggregated")
SCENARIOS = ("mixed", "kill_prefill", "kill_decode", "small_kv")
#: (prefill workers, decode workers) of each mode.
WORKERS = {"pd": (1, 1), "aggregated": (0, 1)}

#: Counts of a full run and of --quick; an explicit flag wins over both.
FULL = {
    "requests": 1000,
    "concurrency": (64, 128),
    "kill_requests": 300,
    "kill_concurrency": 32,
    "small_kv_requests": 64,
    "small_kv_concurrency": 16,
    "verify": 8,
}
QUICK = {
    "requests": 60,
    "concurrency": (16,),
    "kill_requests": 60,
    "kill_concurrency": 16,
    "small_kv_requests": 16,
    "small_kv_concurrency": 8,
    "verify": 4,
}


@dataclass
class LoadOptions:
    modes: tuple[str, ...] = MODES
    scenarios: tuple[str, ...] = SCENARIOS
    model: str = "tiny"
    requests: int = FULL["requests"]
    concurrency: tuple[int, ...] = FULL["concurrency"]
    kill_requests: int = FULL["kill_requests"]
    kill_concurrency: int = FULL["kill_concurrency"]
    small_kv_requests: int = FULL["small_kv_requests"]
    small_kv_concurrency: int = FULL["small_kv_concurrency"]
    small_kv_memory: str = "4MiB"
    small_kv_prompt_chars: int = 1500
    kv_memory: str = "256MiB"
    threads: int = 1
    request_timeout_s: float = 300.0
    time_limit_s: float = 1800.0
    settle_s: float = 15.0
    verify: int = FULL["verify"]
    seed: int = 0
    quick: bool = False
    progress: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> LoadOptions:
        """The options back from JSON (lists become tuples again; unknown keys are dropped)."""
        known = {f.name for f in fields(cls)}
        data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        return cls(**data)


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    if not out or any(x not in allowed for x in out):
        raise ValueError(f"--{flag}: expected some of {', '.join(allowed)}, got {text!r}")
    return out


def options_from_args(args: argparse.Namespace) -> LoadOptions:
    """The options of the parsed command line; ValueError for a bad one."""
    counts = QUICK if args.quick else FULL
    pick = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in counts.items()}
    if args.concurrency is not None:
        try:
            pick["concurrency"] = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
        except ValueError:
            raise ValueError("--concurrency takes integers separated by commas") from None
    opts = LoadOptions(
        modes=_names(args.modes, MODES, "modes"),
        scenarios=_names(args.scenarios, SCENARIOS, "scenarios"),
        model=args.model,
        small_kv_memory=args.small_kv_memory,
        small_kv_prompt_chars=args.small_kv_prompt_chars,
        kv_memory=args.kv_memory,
        threads=args.threads,
        request_timeout_s=args.request_timeout_s,
        time_limit_s=args.time_limit_s,
        settle_s=args.settle_s,
        seed=args.seed,
        quick=args.quick,
        progress=sys.stderr.isatty(),
        **pick,
    )
    counted = (
        "requests",
        "kill_requests",
        "kill_concurrency",
        "small_kv_requests",
        "small_kv_concurrency",
    )
    if any(getattr(opts, k) < 1 for k in counted):
        raise ValueError("request counts and concurrency levels must be >= 1")
    if not opts.concurrency or min(opts.concurrency) < 1:
        raise ValueError("--concurrency needs levels >= 1")
    if opts.verify < 0 or opts.small_kv_prompt_chars < 10:
        raise ValueError("--verify must be >= 0 and --small-kv-prompt-chars >= 10")
    if opts.request_timeout_s <= 0 or opts.time_limit_s <= 0 or opts.settle_s < 0:
        raise ValueError("timeouts and the time limit must be positive")
    return opts
