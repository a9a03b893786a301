"""The engine's command-line flags, defined once for every command that takes them.

`hybrid-pd generate`, `hybrid-pd serve` and the worker process (`python -m
hybrid_pd.workers.main`) add the same flags through `add_engine_flags`: one name, type and
set of choices each. What differs per command is its own: the help text it shows and
whether the flag has a default there (`serve`'s come from `ServeConfig`, so its flags
default to None and override a YAML file only when given). The parsed flags become an
engine configuration through `workers.settings.EngineSettings.of`. No torch here: the CLI
reads its flags before it imports an engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from hybrid_pd.api.sizes import held_state_rows_arg

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
    for flag, (kwargs, default) in ENGINE_FLAGS.items():
        if only is not None and flag not in only:
            continue
        text = {"help": help[flag]} if flag in help else {}
        p.add_argument(flag, **kwargs, **text, default=default if defaults else None)
