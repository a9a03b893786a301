"""Linear layers through oneDNN on CPU.

PyTorch sends a CPU float32 `F.linear` to MKL's GEMM, which on AMD processors runs its AVX2
code path: about 85 GFLOP/s on one Zen 5 core, against about 210 GFLOP/s for oneDNN's
AVX-512 kernels (the ones vLLM's CPU build uses). A prefill step is mostly these GEMMs, so
this is most of the gap to vLLM there. oneDNN sums in a different order than MKL: results
agree to float32 rounding, not bit for bit. bfloat16 takes this path only where oneDNN has
bfloat16 kernels for the processor (`onednn_dtype`); an AVX2-only CPU keeps `F.linear` for it.

One input row (a one-sequence decode step) goes to `cpu_kernels.gemv` instead, where it
applies: that step waits on memory, and the kernel reads the weights faster.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine import cpu_kernels

_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_dtype(dtype: torch.dtype) -> bool:
    """Whether oneDNN's CPU linear takes `dtype` here: float32 wherever oneDNN is available,
    bfloat16 only where the processor has bfloat16 kernels (oneDNN refuses it on an AVX2-only
    CPU, so such a machine keeps PyTorch's own path)."""
    if dtype not in _DTYPES or not onednn_available():
        return False
    if dtype is torch.bfloat16:
        supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(supported is not None and supported())
    return True


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """One row of x on the CPU: the C kernel (`cpu_kernels.gemv`), or None."""
    if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
        return cpu_kernels.gemv(x, weight, bias)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear`, through oneDNN when the operands are CPU tensors it handles (one row
    through `cpu_kernels.gemv` where it applies)."""
    if (y := _one_row(x, weight, bias)) is not None:
        return y
    if (
        x.device.type == "cpu"
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and x.numel()
        and onednn_dtype(x.dtype)
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] reordered once into oneDNN's blocked layout (an opaque mkldnn
    tensor `_linear_pointwise` takes in its place), or None where that is not available.
    The reorder only moves values: the products are those of the plain weight's kernels
    for more than one row (one row takes another kernel either way), 10-40% faster at
    the engine's shapes since no call reorders the weight again."""
    if weight.device.type != "cpu" or not onednn_dtype(weight.dtype):
        return None
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None:
        return None
    try:
        return reorder(weight.detach(), None)
    except RuntimeError:
        return None


class PackedWeights:
    """`pack_weight` copies of weights that are not `nn.Linear`s (the MoE experts' stacked
    matrices), by name, each rebuilt when its weight changes. `layout` turns the weight into
    the [out, in] matrix to pack (a reshape or a permuted copy), only when it is rebuilt."""

    def __init__(self) -> None:
        self._packs: dict[object, tuple[torch.Tensor | None, tuple]] = {}

    def get(
        self,
        name: object,
        weight: torch.Tensor,
        layout: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.shape)
        hit = self._packs.get(name)
        if hit is None or hit[1] != key:
            matrix = weight if layout is None else layout(weight.detach())
            hit = self._packs[name] = (pack_weight(matrix), key)
        return hit[0]


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None):
    """`linear(x, weight)` (no bias) through `packed`, the `pack_weight` copy of `weight`."""
    if (y := _one_row(x, weight, None)) is not None:
        return y
    if packed is not None and x.dtype is weight.dtype and x.device.type == "cpu" and x.numel():
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return linear(x, weight)


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward goes through `linear`, with its weight packed for oneDNN
    (`pack_weight`, kept beside the parameter, rebuilt when the parameter changes); same
    parameters and names."""

    _packed: tuple[torch.Tensor, tuple] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (y := _one_row(x, w, self.bias)) is not None:
            return y
        if x.dtype is w.dtype and x.device.type == "cpu" and x.numel():
            key = (w.data_ptr(), w._version, w.dtype, w.shape)
            packed = self._packed
            if packed is None or packed[1] != key:
                got = pack_weight(w)
                packed = self._packed = None if got is None else (got, key)
            if packed is not None and (self.bias is None or self.bias.dtype is x.dtype):
                return torch.ops.mkldnn._linear_pointwise(x, packed[0], self.bias, "none", [], "")
        return linear(x, w, self.bias)


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


class FusedLinears:
    """Sibling linears that read the same input (q / k / v, gate / up) as one GEMM on
    oneDNN's CPU path: their weights, and biases, side by side in one packed matrix (built
    on first use, rebuilt when any of them changes), the output split back into theirs
    (views). One call instead of several; at one or a few rows each call is mostly fixed
    cost, and narrow outputs (k, v) run oneDNN's kernels far below their peak. Elsewhere
    (other devices, dtypes oneDNN does not take here) each linear runs on its own.

    Not a module: the linears stay where the checkpoint names them, with their parameters."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self._pack: tuple[torch.Tensor | None, torch.Tensor | None, tuple] | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
            # one row: each its own C call (no second copy of the weights side by side)
            ys = [cpu_kernels.gemv(x, m.weight, m.bias) for m in self.linears]
            if all(y is not None for y in ys):
                return tuple(ys)
        packed, bias = self._packed(x)
        if packed is None:
            return tuple(m(x) for m in self.linears)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out.split(self.sizes, dim=-1)

    def _packed(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if x.device.type != "cpu" or not x.numel():
            return None, None
        params = [p for m in self.linears for p in (m.weight, m.bias) if p is not None]
        if any(p.dtype is not x.dtype or p.device != x.device for p in params):
            return None, None
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._pack is None or self._pack[2] != key:
            weight = torch.cat([m.weight.detach() for m in self.linears])
            bias = None
            if any(m.bias is not None for m in self.linears):
                bias = torch.cat(
                    [
                        m.bias.detach() if m.bias is not None else x.new_zeros(m.out_features)
                        for m in self.linears
                    ]
                )
            self._pack = (pack_weight(weight), bias, key)
        return self._pack[0], self._pack[1]

    def __getstate__(self) -> dict:
        # the packed copy is an opaque oneDNN tensor (neither copied nor pickled): rebuilt
        return {**self.__dict__, "_pack": None}
