"""Attention in C over the paged pool, keys and values read where they lie: one query token
per sequence (`decode_attention`, source `csrc/decode_attention.c`) and a prompt chunk's
queries (`prompt_attention`, source `csrc/prompt_attention.c`). Each returns None where its
kernel does not apply (then the caller gathers the blocks and runs SDPA)."""

from __future__ import annotations

import torch

from hybrid_pd.engine.cpu_kernels.common import check_code, ptr, split_threads, variant
from hybrid_pd.engine.cpu_kernels.loader import kernel_threads, library, threads_match


def _attention_operands(q, cache, sinks, *indices) -> tuple | None:
    """(Hq, Hkv, D, `sinks` as contiguous float32 or None) when q [rows, Hq, D] and the
    layer's pool [N, 2, B, Hkv, D] fit the attention kernels (on the CPU, D contiguous, Hq
    a multiple of Hkv), `sinks` is None or [Hq] on the CPU, and each (tensor, dtype) of
    `indices` is a contiguous CPU tensor of that dtype; else None."""
    if q.device.type != "cpu" or cache.device.type != "cpu" or q.dim() != 3 or cache.dim() != 5:
        return None
    _, hq, d = q.shape
    hkv = cache.shape[3]
    if cache.shape[1] != 2 or cache.shape[4] != d or hq % hkv:
        return None
    if q.stride(2) != 1 or cache.stride(4) != 1:
        return None
    for t, dtype in indices:
        if t.dtype is not dtype or t.device.type != "cpu" or not t.is_contiguous():
            return None
    if sinks is not None:
        if sinks.shape != (hq,) or sinks.device.type != "cpu":
            return None
        sinks = sinks.float().contiguous()
    return hq, hkv, d, sinks


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    read: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One query token per sequence attending to its keys in the paged pool, in C, read
    where they lie; None where the kernel does not apply. q [S, Hq, D]; cache the layer's
    pool [N, 2, B, Hkv, D] (K then V of each block), both float32 or both bfloat16 on the
    CPU, D contiguous. Sequence s reads blocks `read[s W : (s + 1) W]` (int64, W =
    len(read) / S) as one run of W B slots and sees slots lo[s] .. hi[s] of it (int32).
    `softcap`: scores become tanh(score / softcap) softcap; `sinks` [Hq]: a logit per query
    head in each softmax's denominator (gpt-oss). Returns [S, Hq, D] in q's type: what
    gathering the blocks and SDPA over the visible slots compute, summed in float32 in
    another order. The sequences are split over torch's threads (`kernel_threads`); where
    the kernels cannot share them (`threads_match`) it declines."""
    if q.dtype not in (torch.float32, torch.bfloat16) or cache.dtype is not q.dtype:
        return None
    if not threads_match():
        return None
    indices = ((read, torch.int64), (lo, torch.int32), (hi, torch.int32))
    found = _attention_operands(q, cache, sinks, *indices)
    if found is None:
        return None
    hq, hkv, d, sinks = found
    seqs = q.shape[0]
    if not seqs or read.numel() % seqs or lo.shape != (seqs,) or hi.shape != (seqs,):
        return None
    lib = library()
    if lib is None:
        return None
    width, bs = read.numel() // seqs, cache.shape[2]
    out = q.new_empty(seqs, hq, d)
    fn = variant(lib, "decode_attention", q.dtype)
    code = fn(
        hq, hkv, d, bs, width, q.data_ptr(), q.stride(0), q.stride(1), cache.data_ptr(),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), read.data_ptr(),
        lo.data_ptr(), hi.data_ptr(), scale, softcap or 0.0,
        ptr(sinks), out.data_ptr(), seqs,
        min(kernel_threads(), seqs),
    )  # fmt: skip
    check_code("decode_attention", code)
    return out


#: Score rows per unit of `prompt_attention`'s work (ROWS_TARGET in the C source).
_PROMPT_ROWS = 128


def prompt_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    read: torch.Tensor,
    first: int,
    lo: torch.Tensor,
    own: int,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A prompt chunk's n queries attending to their keys in the paged pool, in C, read
    where they lie; None where the kernel does not apply. q [n, Hq, D]; cache the layer's
    pool [N, 2, B, Hkv, D], both float32 or both bfloat16 (computed in float32, the output
    rounded once) on the CPU, D contiguous. Keys are numbered along
    the blocks `read` (int64) from slot `first` of the first; query i sees keys lo[i] ..
    own + i (int32 `lo`, never decreasing). `softcap` and `sinks` as in `decode_attention`.
    Returns [n, Hq, D]: what SDPA with the causal (window, chunk) mask computes, summed in
    float32 in another order, each key chunk's scores with a running max (no n x keys
    matrix). Work splits over torch's threads (`kernel_threads`) by KV head and block of
    queries, each computed whole by one thread: the result does not depend on the count;
    where the kernels cannot share torch's threads (`threads_match`) it declines."""
    if q.dtype not in (torch.float32, torch.bfloat16) or cache.dtype is not q.dtype:
        return None
    if not threads_match():
        return None
    found = _attention_operands(q, cache, sinks, (read, torch.int64), (lo, torch.int32))
    if found is None:
        return None
    hq, hkv, d, sinks = found
    n = q.shape[0]
    if not n or lo.shape != (n,):
        return None
    lib = library()
    if lib is None:
        return None
    g = hq // hkv
    per = max(1, _PROMPT_ROWS // g)
    units = hkv * -(-n // per)
    keys = own + n - int(lo[0])
    out = q.new_empty(n, hq, d)
    fn = variant(lib, "prompt_attention", q.dtype)
    code = fn(
        hq, hkv, d, cache.shape[2], n, q.data_ptr(), q.stride(0), q.stride(1),
        cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        read.data_ptr(), first, lo.data_ptr(), own, scale, softcap or 0.0,
        ptr(sinks), out.data_ptr(),
        split_threads(units, n * keys * hq * d),
    )  # fmt: skip
    check_code("prompt_attention", code)
    return out
