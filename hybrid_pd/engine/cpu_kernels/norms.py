"""Norms and rotations in C: the RMS norm of rows (`rms_norm`), the gated RMS norms of
Qwen3.5 (`norm_gate`) and Mamba2 (`gate_norm`), the delta rule's L2 norm (`l2_norm`), and a
per-head RMS norm then RoPE (`norm_rope`). Source `csrc/norms.c`. Each returns None where its
kernel does not apply (then the caller takes its PyTorch path)."""

from __future__ import annotations

import torch

from hybrid_pd.engine.cpu_kernels.common import (
    ROWS_SPLIT_MIN,
    check_code,
    library_if,
    ptr,
    split_threads,
    variant,
    vector_or_none,
)
from hybrid_pd.engine.cpu_kernels.loader import library


def l2_norm(x: torch.Tensor, heads: int, scale: float, eps: float) -> torch.Tensor | None:
    """Each of the `heads` heads side by side in x's rows L2-normed, then times `scale`:
    (x * rsqrt(sum(x^2) + eps)) * scale per head, in one C pass; None where the kernel does
    not apply. x [T, heads * dim] float32 on the CPU, rows of any stride, the channels
    contiguous. Returns [T, heads, dim] (the delta rule's q and k)."""
    if x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        return None
    tokens, width = x.shape
    if heads < 1 or width % heads or x.stride(1) != 1 or not x.numel():
        return None
    lib = library()
    if lib is None:
        return None
    dim = width // heads
    out = x.new_empty(tokens, heads, dim)
    lib.l2_norm_f32(
        tokens, heads, dim, x.data_ptr(), x.stride(0), scale, eps, out.data_ptr(),
        split_threads(tokens, tokens * width, ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out


def norm_gate(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """Qwen3.5's gated RMS norm, (weight * x rsqrt(mean(x^2) + eps)) * silu(z) per vector
    of the last dim, in one C pass; None where the kernel does not apply. x and z
    [T, H, dim] (the last dim contiguous), weight [dim], all float32 or all bfloat16 on the
    CPU. In bfloat16 it rounds where `GatedRMSNorm.forward` does. Returns [T, H, dim]."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return None
    if z.dtype is not x.dtype or weight.dtype is not x.dtype or z.device.type != "cpu":
        return None
    if x.dim() != 3 or z.shape != x.shape or weight.shape != x.shape[-1:]:
        return None
    if x.stride(-1) != 1 or z.stride(-1) != 1 or not weight.is_contiguous():
        return None
    lib = library()
    if lib is None:
        return None
    tokens, heads, dim = x.shape
    out = x.new_empty(tokens, heads, dim)
    fn = variant(lib, "norm_gate", x.dtype)
    code = fn(
        tokens, heads, dim, x.data_ptr(), *x.stride()[:2], z.data_ptr(), *z.stride()[:2],
        weight.data_ptr(), eps, out.data_ptr(),
        split_threads(tokens, tokens * heads * dim, ROWS_SPLIT_MIN),
    )  # fmt: skip
    check_code("norm_gate", code)
    return out


def gate_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor | None:
    """Mamba2's gated RMS norm, weight * norm(y * silu(z)) over groups of `group` channels,
    in one C pass; None where the kernel does not apply. y [T, inner] float32, z [T, inner]
    and weight [inner] both float32 or both bfloat16, on the CPU, rows of any stride, the
    channels contiguous. Returns [T, inner] float32, as `mamba2.GatedRMSNorm` computes."""
    if y.dtype is not torch.float32 or z.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype is not z.dtype or y.dim() != 2 or z.shape != y.shape:
        return None
    if any(t.device.type != "cpu" for t in (y, z, weight)) or not weight.is_contiguous():
        return None
    if y.stride(1) != 1 or z.stride(1) != 1 or weight.shape != y.shape[1:]:
        return None
    lib = library()
    if lib is None:
        return None
    tokens, inner = y.shape
    out = y.new_empty(tokens, inner)
    fn = variant(lib, "gate_norm", z.dtype)
    code = fn(
        tokens, inner, group, y.data_ptr(), y.stride(0), z.data_ptr(), z.stride(0),
        weight.data_ptr(), eps, out.data_ptr(),
        split_threads(tokens, tokens * inner, ROWS_SPLIT_MIN),
    )  # fmt: skip
    if code:
        return None  # a group that does not divide the channels
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, after_cast=False
) -> torch.Tensor | None:
    """x * rsqrt(mean(x^2) + eps) * (weight + offset) over the last dim, in one C pass;
    None where the kernel does not apply. x and weight both float32 or both bfloat16, on the
    CPU; x of any leading shape whose rows lie a fixed stride apart (the last dim
    contiguous), weight contiguous. In bfloat16 it computes in float32 and rounds where
    `models.common.RMSNorm` does: once at the end, or with `after_cast` the normalised x
    and weight + offset first, then their product. One call instead of F.rms_norm's several
    operations: what a one-token decode step pays per norm (about 36 against 4 us at 512
    channels); in bfloat16 instead of five operations and two casts."""
    dtype = x.dtype
    if dtype not in (torch.float32, torch.bfloat16) or weight.dtype is not dtype:
        return None
    if x.dim() < 1 or x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    if not weight.is_contiguous():
        return None
    dim = x.shape[-1]
    if weight.shape != (dim,) or x.stride(-1) != 1 or not x.numel():
        return None
    if x.dim() == 1:
        rows, row_stride = 1, dim
    elif x.dim() == 2:
        rows, row_stride = x.shape[0], x.stride(0)
    elif x.is_contiguous():
        rows, row_stride = x.numel() // dim, dim
    else:
        return None
    lib = library()
    if lib is None:
        return None
    out = x.new_empty(x.shape)
    threads = split_threads(rows, rows * dim, ROWS_SPLIT_MIN)
    args = (rows, dim, x.data_ptr(), row_stride, weight.data_ptr(), offset, eps, out.data_ptr())
    if dtype is torch.float32:
        lib.rms_norm_f32(*args, threads)
    else:
        lib.rms_norm_bf16(*args, int(bool(after_cast)), threads)
    return out


def norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
) -> torch.Tensor | None:
    """Each head of x [T, H, D] RMS-normed (`rms_norm`'s form; `weight` None: not normed),
    then rotated by cos / sin [T, 1, R] (rotate-half layout, `models.rope.rotate`) on its
    first R dims, in one C pass; None where the kernel does not apply. float32 on the CPU;
    x's heads may lie in a wider row (a view of a fused q / k / v output). Returns [T, H, D]
    contiguous."""
    if x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() != 3 or not x.numel():
        return None
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or cos.shape != sin.shape or cos.dim() != 3:
        return None
    if cos.shape[0] != tokens or cos.shape[1] != 1 or cos.shape[2] > dim or cos.shape[2] % 2:
        return None
    for t in (cos, sin):
        if t.dtype is not torch.float32 or t.device.type != "cpu" or t.stride(2) != 1:
            return None
    if cos.stride(0) != sin.stride(0):
        return None
    lib = library_if(vector_or_none(weight, dim, torch.float32))
    if lib is None:
        return None
    out = x.new_empty(tokens, heads, dim)
    code = lib.norm_rope_f32(
        tokens, heads, dim, cos.shape[2], x.data_ptr(), x.stride(0), x.stride(1),
        ptr(weight), offset, eps, cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
        split_threads(tokens, tokens * heads * dim, ROWS_SPLIT_MIN),
    )  # fmt: skip
    if code:
        return None  # a head too wide for the kernel
    return out
