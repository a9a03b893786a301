"""What an operator sees of `serve`: Ray's forwarded lines, and the checks made before
anything starts. The logging set-up itself (stderr, one format, one level) is `api/logs.py`,
shared with the proxy; its names are re-exported here for the launcher.

Light on purpose (no torch, no Ray): the CLI runs these before it starts anything heavy, and
every worker actor calls `configure_logging` first thing.
"""

from __future__ import annotations

import errno
import os
import socket
import sys

from hybrid_pd.api.logs import (
    DATE_FORMAT,
    LOG_FORMAT,
    LOG_LEVELS,
    configure_logging,
    level_of,
)

__all__ = [
    "DATE_FORMAT",
    "LOG_FORMAT",
    "LOG_LEVELS",
    "PortUnavailable",
    "check_port",
    "configure_logging",
    "forward_ray_logs_plainly",
    "level_of",
    "name_log_prefix",
]


def forward_ray_logs_plainly() -> None:
    """How Ray prints the workers' lines on the driver's console (environment variables Ray
    reads; set ones are kept): each line as it comes, not held back up to 5 s to be merged
    with similar lines of other workers (the prefix names the worker, so no two are the
    same); no colour codes unless stderr is a terminal. Call before `import ray`."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def name_log_prefix(name: str) -> None:
    """Inside a Ray actor: put `name` in front of this process's forwarded lines from now on.
    Ray does this itself with the actor's repr, but only once `__init__` has returned; the
    model loading comes before. The marker is Ray's own (its log monitor reads it from the
    worker's stdout and stderr files), hence a write, not a log record."""
    try:
        from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME
    except ImportError:  # another Ray: its prefix names the class until __init__ ends
        return
    for stream in (sys.stdout, sys.stderr):
        stream.write(f"{LOG_PREFIX_ACTOR_NAME}{name}\n")
        stream.flush()


class PortUnavailable(ValueError):
    """The proxy's address cannot be listened on: the port is taken, or the host is not an
    address of this machine."""


def check_port(host: str, port: int) -> None:
    """Raise PortUnavailable unless a socket could listen on `host`:`port` now. Port 0 (any
    free port) always passes. Same socket option as the proxy's server (SO_REUSEADDR), so
    a port left in TIME_WAIT by a previous run does not count as taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortUnavailable(
                    f"port {port} on {host} is in use (another process listens there; "
                    "choose another with --port)"
                ) from None
            if e.errno == errno.EACCES:
                raise PortUnavailable(
                    f"port {port} on {host} needs privileges (ports below 1024); "
                    "choose another with --port"
                ) from None
            raise PortUnavailable(
                f"cannot listen on {host}:{port} ({e.strerror or e}); check --host"
            ) from None
