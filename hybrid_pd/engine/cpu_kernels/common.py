"""What the family modules share: how many threads a call splits over, the checks and
pointers of optional arguments, the library once the operands fit, and the check of a
kernel's return code."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from hybrid_pd.engine.cpu_kernels.loader import kernel_threads, library

#: Below this many state elements times tokens a call is not split over threads.
SPLIT_MIN_WORK = 1 << 20
#: Below this many elements an element-wise kernel (`act_mul`, the norms) is not split.
ROWS_SPLIT_MIN = 1 << 16


def split_threads(units: int, work: int, least: int = SPLIT_MIN_WORK) -> int:
    """Threads for a call over `units` independent units (state heads, sequences, rows):
    torch's (`kernel_threads`) when the work (state elements times tokens, or elements)
    pays for a split, else 1."""
    return max(1, min(kernel_threads(), units)) if work >= least else 1


def vector_or_none(t: torch.Tensor | None, n: int, dtype: torch.dtype) -> bool:
    """Whether `t` (a bias, a norm's weight) is None or a contiguous [n] tensor of `dtype` on
    the CPU, as the kernels take it."""
    return t is None or (
        t.dtype is dtype and t.device.type == "cpu" and t.shape == (n,) and t.is_contiguous()
    )


def library_if(fits: bool) -> ctypes.CDLL | None:
    """The kernels' library when the operands fit the kernel (`fits`, checked first, so a
    call that cannot use the kernels never loads them) and it loaded; None otherwise: the
    caller takes its PyTorch path."""
    return library() if fits else None


#: The suffix of a kernel's variant for each element type it takes.
_VARIANT = {torch.float32: "f32", torch.bfloat16: "bf16"}


def variant(lib: ctypes.CDLL, kernel: str, dtype: torch.dtype) -> Callable[..., int]:
    """`kernel`'s entry point for `dtype` in `lib` (`{kernel}_f32` or `{kernel}_bf16`)."""
    return getattr(lib, f"{kernel}_{_VARIANT[dtype]}")


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer of an optional argument (NULL for None)."""
    return None if t is None else t.data_ptr()


def is_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def check_code(kernel: str, code: int) -> None:
    """RuntimeError when `kernel` returned a non-zero code: it refused its arguments."""
    if code:
        raise RuntimeError(f"{kernel} refused its arguments (code {code})")
