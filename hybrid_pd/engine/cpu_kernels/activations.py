"""Activations in C: act(gate) * up in one pass (`act_mul`). Source `csrc/activations.c`."""

from __future__ import annotations

import torch

from hybrid_pd.engine.cpu_kernels.common import ROWS_SPLIT_MIN, split_threads, variant
from hybrid_pd.engine.cpu_kernels.loader import library

#: The activations `act_mul` takes, by the name its callers use.
ACTIVATIONS = ("silu", "gelu_tanh")


def act_mul(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """act(gate) * up in one pass, in C, for act "silu" or "gelu_tanh" (GELU's tanh form);
    None where the kernel does not apply. gate and up [rows, cols], float32 or bfloat16 on
    the CPU, rows of any stride (the halves of one projection), columns contiguous. bfloat16
    is computed in float32 and rounded once (PyTorch rounds act(gate) first); the exp inside
    within 2 ulp of float32's."""
    if act not in ACTIVATIONS or gate.dtype not in (torch.float32, torch.bfloat16):
        return None
    if up.dtype is not gate.dtype or gate.dim() != 2 or up.shape != gate.shape:
        return None
    if gate.device.type != "cpu" or up.device.type != "cpu":
        return None
    if gate.stride(1) != 1 or up.stride(1) != 1:
        return None
    lib = library()
    if lib is None:
        return None
    rows, cols = gate.shape
    out = gate.new_empty(rows, cols)
    fn = variant(lib, "act_mul", gate.dtype)
    fn(
        rows, cols, gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
        out.data_ptr(), ACTIVATIONS.index(act),
        split_threads(rows, rows * cols, ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out
