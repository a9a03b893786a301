"""Linear layers through oneDNN on CPU.

PyTorch sends a CPU float32 `F.linear` to MKL's GEMM, which on AMD processors runs its AVX2
code path: about 85 GFLOP/s on one Zen 5 core, against about 210 GFLOP/s for oneDNN's
AVX-512 kernels (the ones vLLM's CPU build uses). A prefill step is mostly these GEMMs, so
this is most of the gap to vLLM there. oneDNN sums in a different order than MKL: results
agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear`, through oneDNN when the operands are CPU tensors it handles."""
    if (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and x.numel()
        and onednn_available()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward goes through `linear`; same parameters and names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Switch every plain `nn.Linear` of `model` to `OneDnnLinear` in place (the class only:
    parameters, names and state dict stay). Returns how many were switched; 0 when oneDNN is
    not available."""
    if not onednn_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
            count += 1
    return count
