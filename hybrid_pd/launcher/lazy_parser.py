"""An argparse parser whose flags are added when it first parses, so that a subcommand's
module is imported only when that subcommand runs (`hybrid-pd bench` and the bench wing)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any


class LazyParser(argparse.ArgumentParser):
    """A subcommand's parser (give it as `add_subparsers(parser_class=LazyParser)`): with
    `fill`, `fill(parser)` adds its flags the first time it parses (its own --help included);
    without, a plain ArgumentParser."""

    def __init__(
        self, *args: Any, fill: Callable[[argparse.ArgumentParser], None] | None = None, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self._fill = fill

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill(self)
        return super().parse_known_args(args, namespace)
