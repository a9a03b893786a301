"""The engine's command-line flags, defined once for every command that takes them.

`hybrid-pd generate`, `hybrid-pd serve` and the worker process (`python -m
hybrid_pd.workers.main`) add the same flags through `add_engine_flags` (the worker flags
and per-role tensor-parallel sizes they share through `add_worker_flags` and
`add_role_tp_flags`): one name, type and set of choices each. What differs per command is
its own: the help text it shows and whether the flag has a default there (`serve`'s come
from `ServeConfig`, so its flags default to None and override a YAML file only when
given). The parsed flags become an engine configuration through
`workers.settings.EngineSettings.of`. No torch here: the CLI reads its flags before it
imports an engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from hybrid_pd.api.sizes import held_state_rows_arg
from hybrid_pd.workers import DEFAULT_MAX_QUEUED

FAILURE_POLICIES = ("recompute", "fail")


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


#: The engine flags: name -> (what argparse needs beyond help and default, the default a
#: command that has defaults gives it).
ENGINE_FLAGS: dict[str, tuple[dict[str, Any], Any]] = {
    "--device": ({}, None),
    "--kv-memory": ({}, "256MiB"),
    "--held-state-rows": ({"type": held_state_rows_arg}, None),
    "--threads": ({"type": int}, None),
    "--failure-policy": ({"choices": FAILURE_POLICIES}, "recompute"),
    "--tensor-parallel-size": ({"type": positive_int}, 1),
}


#: The worker flags `serve` and the worker process share, in the same form.
WORKER_FLAGS: dict[str, tuple[dict[str, Any], Any]] = {
    "--secret-file": ({}, None),
    "--ucx-tls": ({}, None),
    "--max-queued": ({"type": int}, DEFAULT_MAX_QUEUED),
}

#: The per-role tensor-parallel sizes of a prefill/decode pair (`serve`, `generate
#: --disaggregated`); None: the command's --tensor-parallel-size.
ROLE_TP_FLAGS: dict[str, tuple[dict[str, Any], Any]] = {
    "--prefill-tensor-parallel-size": ({"type": positive_int}, None),
    "--decode-tensor-parallel-size": ({"type": positive_int}, None),
}


def _add_flags(
    table: Mapping[str, tuple[dict[str, Any], Any]],
    p: argparse.ArgumentParser,
    help: Mapping[str, str],
    defaults: bool,
    only: tuple[str, ...] | None,
) -> None:
    for flag, (kwargs, default) in table.items():
        if only is not None and flag not in only:
            continue
        text = {"help": help[flag]} if flag in help else {}
        p.add_argument(flag, **kwargs, **text, default=default if defaults else None)


def add_engine_flags(
    p: argparse.ArgumentParser,
    help: Mapping[str, str],
    *,
    defaults: bool = True,
    only: tuple[str, ...] | None = None,
) -> None:
    """Adds the engine flags (`only` those, when given) to `p`. `help`: the command's text
    per flag (a flag it does not name shows none); `defaults`: False leaves every flag's
    default None (the command's settings object supplies the real one)."""
    _add_flags(ENGINE_FLAGS, p, help, defaults, only)


def add_worker_flags(
    p: argparse.ArgumentParser, help: Mapping[str, str], *, defaults: bool = True
) -> None:
    """Adds `WORKER_FLAGS` to `p`; `help` and `defaults` as in `add_engine_flags`."""
    _add_flags(WORKER_FLAGS, p, help, defaults, None)


def add_role_tp_flags(p: argparse.ArgumentParser, help: Mapping[str, str]) -> None:
    """Adds `ROLE_TP_FLAGS` (default None) to `p` with the command's `help` per flag."""
    _add_flags(ROLE_TP_FLAGS, p, help, True, None)
