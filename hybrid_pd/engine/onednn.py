"""Linear layers through oneDNN on CPU.

PyTorch sends a CPU float32 `F.linear` to MKL's GEMM, which on AMD processors runs its AVX2
code path: about 85 GFLOP/s on one Zen 5 core, against about 210 GFLOP/s for oneDNN's
AVX-512 kernels (the ones vLLM's CPU build uses). A prefill step is mostly these GEMMs, so
this is most of the gap to vLLM there. oneDNN sums in a different order than MKL: results
agree to float32 rounding, not bit for bit. bfloat16 takes this path only where oneDNN has
bfloat16 kernels for the processor (`onednn_dtype`); on a CPU without them (AVX2 only) a
packed bfloat16 weight of two or more rows goes to the C kernels' panels, which keep the
weight in bfloat16 and compute in float32 (about 4x `F.linear`'s bfloat16 there), and an
unpacked one keeps `F.linear`.

A float32 weight that is packed once (`pack_weight`: every `OneDnnLinear`, `FusedLinears`
and `PackedWeights`) goes to the C kernels' own GEMM instead (`cpu_kernels.panel_linear`,
the weight reordered into panels of 32 output columns): for the few rows of a decode step
it reads the weights at about the memory's speed, where oneDNN's small-row kernels reach
12-14 GB/s here (batch 8: 1.5-1.8x faster); for many rows the two are bound by the
multiply-adds alike. It splits its panels over torch's own OpenMP threads; where it cannot
(`cpu_kernels.threads_match`), float32 keeps oneDNN's threaded GEMM (`pack_weight`), and
bfloat16 without bfloat16 kernels `F.linear`. Each of its outputs is one sum in order, so
a row's result depends neither on the batch it is in nor on the thread count (bfloat16: nor
on which batch of two or more rows). One input row of any other weight (bfloat16, or not
packed) goes to `cpu_kernels.gemv` where it applies: that step waits on memory, and the
kernel reads the weights faster than the library (and twice as fast as the bfloat16
panels' widening), so a bfloat16 row alone sums in gemv's order, in a batch in the panels'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

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


def _panel_dtype(dtype: torch.dtype) -> bool:
    """Whether a weight of `dtype` is packed into the C kernels' panels: float32 always,
    bfloat16 only where oneDNN has no bfloat16 kernels for this processor (`onednn_dtype`;
    the panels then compute in float32, several times faster than `F.linear` in bfloat16
    there). Where it has them, bfloat16 stays on oneDNN's native bfloat16 GEMM."""
    return dtype is torch.float32 or (dtype is torch.bfloat16 and not onednn_dtype(dtype))


@dataclass(frozen=True)
class Panels:
    """A weight as `cpu_kernels.pack_panels` reorders it (float32, or bfloat16 where
    `_panel_dtype`), with its output count."""

    data: torch.Tensor  # [ceil(n / 32), in, 32]
    n: int


def pack_weight(weight: torch.Tensor) -> torch.Tensor | Panels | None:
    """`weight` [out, in] reordered once for the CPU: float32 into the C kernels' panels
    (`Panels`, see below), anything else into oneDNN's blocked
    layout (an opaque mkldnn tensor `_linear_pointwise` takes in its place), or None where
    neither is available. The reorder only moves values; oneDNN's runs 10-40% faster at the
    engine's shapes than the plain weight, since no call reorders it again. `packed_linear`
    and `run_packed` take either.

    Panels wherever the kernel splits over as many threads as torch runs
    (`cpu_kernels.threads_match`: one thread, or torch's OpenMP threads shared). Where it
    cannot, oneDNN's GEMM splits over torch's threads: one thread of ours beside torch's
    spinning ones lost (on two threads a batch-8 prefill took 2.1 s against 1.5 s)."""
    if weight.device.type != "cpu":
        return None
    if _panel_dtype(weight.dtype) and cpu_kernels.threads_match():
        panels = cpu_kernels.pack_panels(weight)
        if panels is not None:
            return Panels(panels, weight.shape[0])
    if not onednn_dtype(weight.dtype):
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


def run_packed(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x through a `pack_weight` copy (and bias), or None where it does not apply (x not a
    CPU tensor of the weight's dtype, no rows, no pack)."""
    if packed is None or x.device.type != "cpu" or not x.numel():
        return None
    if isinstance(packed, Panels):
        return cpu_kernels.panel_linear(x, packed.data, packed.n, bias)
    if x.dtype is not packed.dtype or (bias is not None and bias.dtype is not x.dtype):
        return None
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _panels_take(x: torch.Tensor, packed) -> bool:
    """Whether x goes to the panels before `gemv`: float32 panels at every row count,
    bfloat16 panels for two or more rows."""
    if not isinstance(packed, Panels):
        return False
    return packed.data.dtype is torch.float32 or x.dim() != 2 or x.shape[0] != 1


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, packed, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear(x, weight, bias)` through `packed`, the `pack_weight` copy of `weight`:
    float32 panels for every row count; bfloat16 panels and a oneDNN pack for two or more
    rows (one row: `gemv`, which reads the bfloat16 weight about twice as fast as the
    panels' widening)."""
    if _panels_take(x, packed) and (y := run_packed(x, packed, bias)) is not None:
        return y
    if (y := _one_row(x, weight, bias)) is not None:
        return y
    if (y := run_packed(x, packed, bias)) is not None:
        return y
    return linear(x, weight, bias)


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward goes through `packed_linear`, with its weight packed
    (`pack_weight`, kept beside the parameter, rebuilt when the parameter changes); same
    parameters and names."""

    _packed: tuple[torch.Tensor, tuple] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype is w.dtype and x.device.type == "cpu" and x.numel():
            key = (w.data_ptr(), w._version, w.dtype, w.shape)
            packed = self._packed
            if packed is None or packed[1] != key:
                got = pack_weight(w)
                packed = self._packed = None if got is None else (got, key)
            if packed is not None:
                return packed_linear(x, w, packed[0], self.bias)
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
        if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu" and not self._panels(x):
            # one row: each its own C call (no second copy of the weights side by side)
            ys = [cpu_kernels.gemv(x, m.weight, m.bias) for m in self.linears]
            if all(y is not None for y in ys):
                return tuple(ys)
        packed, bias = self._packed(x)
        out = run_packed(x, packed, bias)
        if out is not None:
            return out.split(self.sizes, dim=-1)
        return tuple(m(x) for m in self.linears)

    def _panels(self, x: torch.Tensor) -> bool:
        """Whether x (one row) goes through the C kernels' panels rather than `gemv`
        (`_panels_take`: float32 panels, kernels built)."""
        return _panels_take(x, self._packed(x)[0])

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
