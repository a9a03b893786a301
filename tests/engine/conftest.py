"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests: on a busy 2-core machine tiny
    matmuls with more threads only spin and wait (up to 50x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
