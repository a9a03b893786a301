"""Test-wide settings."""

import logging

import pytest
import torch

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
