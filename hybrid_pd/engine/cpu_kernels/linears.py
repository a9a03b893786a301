"""Linears in C: one input row (`gemv`, float32 or bfloat16) and rows against a weight packed
into panels (`pack_panels`, `panel_linear`; float32, or bfloat16 summed in float32). Source
`csrc/linears.c`. Each returns None where its kernel does not apply (then the caller takes
oneDNN's GEMM)."""

from __future__ import annotations

import torch

from hybrid_pd.engine.cpu_kernels.common import (
    check_code,
    library_if,
    ptr,
    split_threads,
    variant,
    vector_or_none,
)
from hybrid_pd.engine.cpu_kernels.loader import kernel_threads, library

#: Fewest weight elements a one-row linear splits over threads for.
_GEMV_SPLIT_MIN = 1 << 18


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for one row of x, in C; None where the kernel does not
    apply (then use the library's GEMM). x [1, k] or [k]; weight [n, k] contiguous, float32
    or bfloat16 (x and bias the same), on the CPU. The sums are float32 in a fixed order:
    they agree with a GEMM to rounding, not bit for bit. With several torch threads the
    rows are split over them. What a one-sequence decode step spends most of its time on:
    every weight is read once, and the kernel prefetches the next rows while it sums (see
    `gemv` in the C source)."""
    if x.dtype is not weight.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    if x.shape not in ((1, k), (k,)) or not weight.is_contiguous():
        return None
    lib = library_if(vector_or_none(bias, n, x.dtype))
    if lib is None:
        return None
    bf16 = x.dtype is torch.bfloat16
    xf = x.reshape(k).float().contiguous() if bf16 else x.reshape(k).contiguous()
    y = x.new_empty((*x.shape[:-1], n))
    fn = variant(lib, "gemv", x.dtype)
    threads = split_threads(n // 64, n * k, _GEMV_SPLIT_MIN)
    fn(k, weight.data_ptr(), xf.data_ptr(), ptr(bias), y.data_ptr(), n, threads)
    return y


def panel_width() -> int | None:
    """Output columns per panel of `pack_panels` (PANEL in the C source, 32 today), as the
    library built for this machine's instruction set has it (csrc/panel_tile.h sizes the
    tile per register file), or None without the kernels."""
    lib = library()
    return None if lib is None else int(lib.panel_width())


_PANEL_DTYPES = (torch.float32, torch.bfloat16)


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [n, k] (float32 or bfloat16, CPU) reordered for `panel_linear`: [ceil(n / P),
    k, P] with P = `panel_width()`, panel p holding output columns p P .. p P + P - 1 (zeros
    past n), in the weight's dtype, or None where the kernels do not apply. The same values,
    as much memory (plus the padding of the last panel)."""
    if weight.dtype not in _PANEL_DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    width = panel_width()
    if width is None:
        return None
    n, k = weight.shape
    count = -(-n // width)
    padded = weight.detach().new_zeros(count * width, k)
    padded[:n] = weight.detach()
    return padded.view(count, width, k).transpose(1, 2).contiguous()


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` with the weight as `pack_panels` made it (`n` its output
    features), in C; None where the kernel does not apply. x [..., k] on the CPU and bias
    [n] or None, both of the panels' dtype (float32 or bfloat16). Each output is one float32
    sum over k in order, so a row's result does not depend on the other rows, nor on the
    thread count; it agrees with a library GEMM to rounding. The panels are split over
    torch's threads (`kernel_threads`; `onednn.pack_weight` packs panels only where
    `threads_match`).

    bfloat16 is computed in float32 (for processors without bfloat16 arithmetic): x and
    the bias widened once per call, each panel widened in the cache as the kernel reaches
    it, the output rounded to bfloat16 once. Its result is the float32 kernel's on the
    widened operands, rounded: bit for bit."""
    dtype = panels.dtype
    if dtype not in _PANEL_DTYPES or x.dtype is not dtype or x.device.type != "cpu":
        return None
    if x.dim() < 1 or not x.numel():
        return None
    count, k, width = panels.shape
    if width != panel_width() or x.shape[-1] != k or not -width < n - count * width <= 0:
        return None
    if not vector_or_none(bias, n, dtype) or not panels.is_contiguous():
        return None
    lib = library()
    if lib is None:
        return None
    bf16 = dtype is torch.bfloat16
    rows = x.reshape(-1, k)
    if bf16:
        rows = rows.float()
        bias = None if bias is None else bias.float()
    elif rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = x.new_empty(m, n)
    code = variant(lib, "panel_linear", dtype)(
        m, n, k, panels.data_ptr(), rows.data_ptr(), rows.stride(0),
        ptr(bias), y.data_ptr(),
        min(kernel_threads(), count),
    )  # fmt: skip
    if bf16:
        check_code("panel_linear_bf16", code)
    return y.view(*x.shape[:-1], n)
