"""One logging set-up for the launcher, the proxy and the worker actors: stderr, one
format, one level. No torch, no Ray: the proxy and the CLI call it before anything heavy."""

from __future__ import annotations

import logging
import sys

#: Levels `--log-level` takes, lowest first.
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time of each record (as logging's own
    last-resort handler does), so a replaced stderr never leaves it writing to a closed file."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns it
        pass


def level_of(name: str) -> int:
    """`--log-level` name -> logging level; ValueError names the choices."""
    if name not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {name!r}")
    return getattr(logging, name.upper())


#: Libraries that log every call at info (httpx: each HTTP request `serve` makes itself):
#: shown at debug only.
_CHATTY = ("httpx", "httpcore")


def configure_logging(level: str) -> None:
    """The root logger at `level`, writing to stderr in LOG_FORMAT through one handler of
    ours (added once per process; called again, only the levels change)."""
    root = logging.getLogger()
    root.setLevel(level_of(level))
    for name in _CHATTY:
        logging.getLogger(name).setLevel(max(level_of(level), logging.WARNING))
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        root.addHandler(handler)
