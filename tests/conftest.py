"""Test-wide settings."""

import torch

# Tiny models on a busy 2-core machine: intra-op threading costs far more than it gains.
torch.set_num_threads(1)
