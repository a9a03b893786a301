"""Token authentication for the Ray instance `serve` embeds.

Ray's servers (GCS, raylet, workers) listen on every interface of the machine whatever
address the driver asks for (it replaces a loopback address with one others can reach).
An embedded instance without authentication would therefore run the code of anyone who
can reach the machine. Before starting one, `serve` turns on Ray's token authentication
with a token made for this run and known only to this process and the Ray processes it
starts (they inherit the environment). An operator who set `RAY_AUTH_MODE` keeps theirs.

Ray reads the mode into its native config when it is first imported: a process that
imported Ray earlier has that config reloaded, and Ray's cached token dropped.
"""

from __future__ import annotations

import os
import secrets
import sys

MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"


def close_embedded_ray(env: dict[str, str] | None = None) -> bool:
    """Set a fresh token (and token mode) in `env` (default: this process's environment)
    unless `RAY_AUTH_MODE` is set already. Returns whether it did."""
    env = os.environ if env is None else env
    if env.get(MODE):
        return False
    env[MODE] = "token"
    env[TOKEN] = secrets.token_hex(32)
    if env is os.environ and "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")  # the mode, from the environment again
        AuthenticationTokenLoader.instance().reset_cache()
    return True
