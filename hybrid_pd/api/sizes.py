"""Sizes as an operator writes them (`40GiB`, `512MB`, `1024`) and the command line's size
flags: what `serve`, `generate`, the worker process and the benchmarks parse alike."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'40GiB' -> 42949672960, '512MB' -> 512000000, '1024' -> 1024."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 1073741824, 40GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


#: The help of every --held-state-rows flag (serve, generate, hybrid-pd-worker).
HELD_STATE_ROWS_HELP = (
    "memory for decode rows' states held between steps (bytes or 256MiB; 0 turns it off; "
    "default a quarter of the KV memory, at most 1GiB)"
)


def held_state_rows_bytes(value: str | int | None) -> int | None:
    """--held-state-rows / `held_state_rows` -> EngineConfig.held_state_rows_bytes (None:
    the engine's default). ValueError names the setting."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"held_state_rows must be a size, got {value!r}")
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"held_state_rows: {e}") from None


def held_state_rows_arg(text: str) -> int:
    """argparse `type` of the --held-state-rows flags: a clear usage error on a bad size."""
    try:
        return held_state_rows_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
