"""Test-wide settings."""

import logging

import pytest
import torch

from hybrid_pd.engine.threads import flush_denormals

# Engines in this process compute as the engine processes do: subnormals flushed to zero,
# set before torch starts a thread.
flush_denormals()
# Tiny models on a busy 2-core machine: intra-op threading costs far more than it gains.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _root_logging():
    """`hybrid-pd`'s main() configures the root logger (a stderr handler, a level): undo it
    after each test, so no later test's logging lands on the terminal."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name): tests.checkpoints.BUILDERS[name]'s checkpoint, built once per run
    (tests only read it)."""
    from tests.checkpoints import BUILDERS

    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = BUILDERS[name](tmp_path_factory.mktemp(f"ckpt-{name}"))
        return built[name]

    return get
