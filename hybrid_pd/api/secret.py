"""The control-plane secret as an operator gives it: flag, file or environment."""

from __future__ import annotations

import os

#: The environment variable that carries the control-plane secret (not the command line).
SECRET_ENV = "HYBRID_PD_SECRET"


def read_secret_file(path: str) -> str:
    """The secret stored in `path` (surrounding whitespace stripped); missing or empty files
    are errors."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except FileNotFoundError:
        raise ValueError(f"secret file {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"secret file {path}: cannot read it ({e.strerror})") from None
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def given_secret(
    secret: str | None, secret_file: str | None, environ: dict[str, str] | None = None
) -> str | None:
    """The secret the operator gave, by precedence: `secret`, then `secret_file`, then the
    HYBRID_PD_SECRET environment variable (an empty variable counts as unset); None if none."""
    if secret is not None:
        if not secret.strip():
            raise ValueError("the secret is empty")
        return secret
    if secret_file is not None:
        return read_secret_file(secret_file)
    value = (os.environ if environ is None else environ).get(SECRET_ENV, "").strip()
    return value or None
