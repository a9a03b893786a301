"""State scans and convolutions in C: the gated delta rule (`gdn_recurrent` over a prompt,
`gdn_step` for one decode token per sequence), Mamba2's SSD (`ssd_scan`, `ssd_step`) and the
depthwise causal convolution then SiLU (`conv_silu`, `conv_step_silu`). Source
`csrc/scans.c`. Each returns None where its kernel does not apply (then the caller takes its
PyTorch path)."""

from __future__ import annotations

import ctypes

import torch

from hybrid_pd.engine.cpu_kernels.common import (
    ROWS_SPLIT_MIN,
    check_code,
    is_f32,
    library_if,
    ptr,
    split_threads,
    vector_or_none,
)
from hybrid_pd.engine.cpu_kernels.loader import library


def _gdn_operands(q, k, v, g, beta, state) -> bool:
    """Whether the gated delta rule's operands fit the C kernels: float32 on the CPU, q/k
    [R, Hk, dk] alike, v [R, Hv, dv] with Hk dividing Hv and dv at most 1024, g/beta [R, Hv]
    with the same strides (R: tokens or sequences). The state's shape is the caller's."""
    if not all(is_f32(t) for t in (q, k, v, g, beta, state)):
        return False
    rows, hk = q.shape[0], q.shape[1]
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != rows or g.shape != (rows, hv):
        return False
    return beta.shape == g.shape and beta.stride() == g.stride() and hv % hk == 0 and dv <= 1024


def _gdn_args(q, k, v, g, beta) -> tuple[int, ...]:
    """The pointers and strides both gated-delta kernels take after their sizes, in order."""
    return (
        q.data_ptr(), *q.stride(), k.data_ptr(), *k.stride(), v.data_ptr(), *v.stride(),
        g.data_ptr(), beta.data_ptr(), *g.stride(),
    )  # fmt: skip


def state_rows(rows: torch.Tensor | None, seqs: int, state: torch.Tensor) -> int | None:
    """The pointer a decode-step kernel takes for `rows`: None (NULL) for states stacked one
    per sequence; else `rows` [S] int64 on the CPU, contiguous, each sequence's index in
    `state`'s first dimension (a paged pool's view: its block id), all in range (ValueError
    otherwise: a bad index would write outside the pool). The indices must differ (one
    state per sequence, as the engine's rows are): a repeated one is updated twice."""
    if rows is None:
        return None
    if rows.dtype is not torch.int64 or rows.device.type != "cpu" or rows.dim() != 1:
        raise ValueError("state rows must be a 1-D int64 CPU tensor")
    if rows.numel() != seqs or not rows.is_contiguous():
        raise ValueError(f"state rows: {seqs} contiguous indices expected")
    if seqs and (int(rows.min()) < 0 or int(rows.max()) >= state.shape[0]):
        raise ValueError(f"state rows out of range for {state.shape[0]} states")
    return rows.data_ptr()


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor | None:
    """The gated delta rule over n tokens of one sequence, in C; None where the kernel does
    not apply (then use the PyTorch path). q/k [n, Hk, dk] (normalised and scaled), v
    [n, Hv, dv], g/beta [n, Hv], all float32 on the CPU, any strides (g and beta the same).
    `state` [Hv, dk, dv] float32, contiguous, is updated in place. Returns o [n, Hv, dv].
    The same sums as `delta_rule_step` token after token (fused multiply-adds aside)."""
    if not _gdn_operands(q, k, v, g, beta, state) or not state.is_contiguous():
        return None
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if state.shape != (hv, dk, dv):
        return None
    lib = library()
    if lib is None:
        return None
    out = q.new_empty(n, hv, dv)

    code = lib.gdn_recurrent(
        n, hk, hv, dk, dv, *_gdn_args(q, k, v, g, beta), state.data_ptr(), out.data_ptr(),
        split_threads(hv, n * dk * dv * hv),
    )  # fmt: skip
    check_code("gdn_recurrent", code)
    return out


def gdn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One decode token for each of S sequences, in C; None where the kernel does not
    apply. q/k [S, Hk, dk] (normalised and scaled), v [S, Hv, dv], g/beta [S, Hv] (the same
    strides), float32 on the CPU; `state` [S, Hv, dk, dv], each sequence's block contiguous
    (sequences may lie apart, as gathered rows do), updated in place; with `rows`
    (`state_rows`), `state` is a pool's view [blocks, Hv, dk, dv] and sequence s's state is
    `state[rows[s]]`, updated where it lies. Returns o [S, Hv, dv]: `gdn_recurrent`'s
    arithmetic for one token, so the same bits as in a prompt."""
    if not _gdn_operands(q, k, v, g, beta, state):
        return None
    seqs, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if state.shape[1:] != (hv, dk, dv) or state.stride()[1:] != (dk * dv, dv, 1):
        return None
    if rows is None and state.shape[0] != seqs:
        return None
    lib = library()
    if lib is None:
        return None
    at = state_rows(rows, seqs, state)
    out = q.new_empty(seqs, hv, dv)
    code = lib.gdn_step(
        seqs, hk, hv, dk, dv, *_gdn_args(q, k, v, g, beta), state.data_ptr(), state.stride(0),
        at, out.data_ptr(), split_threads(seqs, seqs * hv * dk * dv),
    )  # fmt: skip
    check_code("gdn_step", code)
    return out


def _ssd_operands(x, dt, a_coef, b, c, state) -> bool:
    """Whether Mamba2's operands fit the C kernels: float32 on the CPU, x [T, H, P],
    dt [T, H], a_coef [H] contiguous, b and c [T, G, N] with the same strides, N contiguous,
    G dividing H."""
    if not all(is_f32(t) for t in (x, dt, a_coef, b, c, state)) or x.dim() != 3:
        return False
    rows, heads = x.shape[0], x.shape[1]
    if dt.shape != (rows, heads) or a_coef.shape != (heads,) or not a_coef.is_contiguous():
        return False
    if b.dim() != 3 or b.shape[0] != rows or heads % b.shape[1]:
        return False
    return c.shape == b.shape and c.stride() == b.stride() and b.stride(-1) == 1


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a_coef: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One decode step of Mamba2's SSD for S sequences, in C, one pass over each state; None
    where the kernel does not apply. x [S, H, P], dt [S, H], a_coef [H], b/c [S, G, N] (the
    same strides; head h reads group h // (H / G)), state [S, H, P, N] with its last dim
    contiguous (rows gathered from the pool may be strided), all float32 on the CPU.
    `state` is updated in place; with `rows` (`state_rows`) it is a pool's view [blocks, H,
    P, N] and sequence s's state is `state[rows[s]]`, updated where it lies. Returns y
    [S, H, P] (no D term): `_ssd_step`'s values, the sum over N in another order."""
    if not _ssd_operands(x, dt, a_coef, b, c, state) or state.stride(-1) != 1:
        return None
    seqs, heads, hd = x.shape
    if state.dim() != 4 or state.shape[1:] != (heads, hd, b.shape[2]):
        return None
    if rows is None and state.shape[0] != seqs:
        return None
    groups, ns = b.shape[1], b.shape[2]
    lib = library()
    if lib is None:
        return None
    at = state_rows(rows, seqs, state)
    y = x.new_empty(seqs, heads, hd)
    code = lib.ssd_step(
        seqs, heads, hd, ns, groups,
        state.data_ptr(), *state.stride()[:3], at, x.data_ptr(), *x.stride(),
        dt.data_ptr(), *dt.stride(), a_coef.data_ptr(), b.data_ptr(), c.data_ptr(),
        *b.stride()[:2], y.data_ptr(), split_threads(seqs, seqs * heads * hd * ns),
    )  # fmt: skip
    check_code("ssd_step", code)
    return y


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a_coef: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    lengths: list[int],
) -> torch.Tensor | None:
    """Mamba2's SSD over the prompts of S sequences packed one after another (sequence i has
    lengths[i] tokens), in C, token by token; None where the kernel does not apply. x
    [T, H, P], dt [T, H], a_coef [H], b/c [T, G, N] (the same strides), all float32 on the
    CPU. `state` [S, H, P, N], contiguous: each sequence's state at its start, updated in
    place to its state at the end. Returns y [T, H, P] (no D term): the values of the
    chunked scan (`mamba2._ssd_packed`), summed as the recurrence does."""
    if not _ssd_operands(x, dt, a_coef, b, c, state) or not state.is_contiguous():
        return None
    total, heads, hd = x.shape
    groups, ns = b.shape[1], b.shape[2]
    seqs = len(lengths)
    if state.shape != (seqs, heads, hd, ns) or sum(lengths) != total:
        return None
    lib = library()
    if lib is None:
        return None
    y = x.new_empty(total, heads, hd)
    lens = (ctypes.c_int * seqs)(*lengths)

    code = lib.ssd_scan(
        seqs, lens, heads, hd, ns, groups,
        state.data_ptr(), x.data_ptr(), *x.stride(), dt.data_ptr(), *dt.stride(),
        a_coef.data_ptr(), b.data_ptr(), c.data_ptr(), *b.stride()[:2], y.data_ptr(),
        split_threads(heads, total * heads * hd * ns),
    )  # fmt: skip
    check_code("ssd_scan", code)
    return y


def conv_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, first: torch.Tensor
) -> torch.Tensor | None:
    """A prompt's depthwise causal convolution then SiLU, in one C pass; None where the
    kernel does not apply. x [W, C] float32 on the CPU (rows a stride apart, channels
    contiguous): the sequences' windows; weight [K, C] contiguous (tap k of channel c);
    bias [C] or None; first [T] int64: the row of x where output t's first tap reads.
    Returns [T, C]: silu(bias + sum over k of x[first + k] weight[k]), summed tap after tap
    from the bias as PyTorch's shifted multiply-adds sum (within float32 rounding)."""
    if not all(is_f32(t) for t in (x, weight)) or x.dim() != 2 or weight.dim() != 2:
        return None
    taps, channels = weight.shape
    if x.shape[1] != channels or x.stride(1) != 1 or not weight.is_contiguous():
        return None
    if not vector_or_none(bias, channels, torch.float32):
        return None
    if first.dtype is not torch.int64 or first.device.type != "cpu" or first.dim() != 1:
        return None
    if not first.is_contiguous() or not first.numel():
        return None
    if int(first.min()) < 0 or int(first.max()) + taps > x.shape[0]:
        return None
    lib = library()
    if lib is None:
        return None
    rows = first.numel()
    out = x.new_empty(rows, channels)
    lib.conv_silu_f32(
        rows, channels, taps, x.data_ptr(), x.stride(0), first.data_ptr(), weight.data_ptr(),
        ptr(bias), out.data_ptr(), split_threads(rows, rows * channels * taps, ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out


def conv_step_silu(
    state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One new token of each of S sequences through a depthwise causal convolution then
    SiLU, in C, with `conv_silu`'s arithmetic per output (a token's output is the same bits
    in a prompt and in a decode step); None where the kernel does not apply. state [S, C,
    K - 1] float32 (the latest inputs, oldest first; sequences a stride apart, the rest
    contiguous) is shifted in place to take x [S, C] (rows a stride apart); with `rows`
    (`state_rows`) it is a pool's view [blocks, C, K - 1] and sequence s's state is
    `state[rows[s]]`, shifted where it lies; weight [C, K] contiguous (conv1d's); bias [C]
    or None. Returns [S, C]."""
    if not all(is_f32(t) for t in (state, x, weight)) or state.dim() != 3 or x.dim() != 2:
        return None
    channels, kept = state.shape[1], state.shape[2]
    seqs = x.shape[0]
    if weight.shape != (channels, kept + 1) or not weight.is_contiguous():
        return None
    if x.shape != (seqs, channels) or x.stride(1) != 1 or not seqs:
        return None
    if (rows is None and state.shape[0] != seqs) or state.stride(2) != 1:
        return None
    if state.stride(1) != kept:
        return None
    lib = library_if(vector_or_none(bias, channels, torch.float32))
    if lib is None:
        return None
    at = state_rows(rows, seqs, state)
    out = x.new_empty(seqs, channels)
    lib.conv_step_silu_f32(
        seqs, channels, kept + 1, state.data_ptr(), state.stride(0), at, x.data_ptr(),
        x.stride(0),
        weight.data_ptr(), ptr(bias), out.data_ptr(),
        split_threads(seqs, seqs * channels * (kept + 1), ROWS_SPLIT_MIN),
    )  # fmt: skip
    return out
