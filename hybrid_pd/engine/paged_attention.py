"""Attention over the paged pool (reference PyTorch, any device).

A step's index tensors depend on the batch and the layer's cache group only, so they are
built once per step and group (`attention_plan`, kept in `ForwardBatch.memo`) and shared
by every layer of the group. The batch splits in two:

    decode rows   sequences that add one token: one scatter writes all their K/V, one
                  gather reads each one's readable blocks into a padded [S, W*B, Hkv, D]
                  tensor, one SDPA call attends all of them. On the CPU a C kernel
                  (`cpu_kernels.decode_attention`) reads the visible slots where they lie
                  instead, in one pass: no copy, no mask (the gather and the masked
                  padding cost more than the attention itself at 32 rows)
    the others    prefill chunks, per sequence: write the chunk's K/V, gather the run of
                  keys its queries may read, attend with a causal (+ window / chunk) mask

A decode row, W blocks of B slots gathered from its block table:

    | first block      | ...  | last block       | null-block padding ... |
    |....xxxxxxxxxxxxxx| .... |xxxxxq...........|........................|
      ^ slid out of the window     ^ not written yet

The slots marked '.' are masked, and zeroed after the gather: their bytes may be anything
(a page last used by a state layer, read as floats, can hold NaN) and SDPA adds its mask to
the scores, which leaves a NaN a NaN.

Attention sinks (gpt-oss): a learned logit per query head joins the softmax denominator
and has no value, so each query's weights sum to less than one. Where a layer has them,
both paths score explicitly (no SDPA): softmax over [masked scores, sink], sink column
dropped. The sink is finite, so even a row whose keys were all masked stays NaN-free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.batch import ForwardBatch, SeqInfo

# Fewest one-token sequences worth the batched decode path (below it they join the loop).
MIN_DECODE_ROWS = 1
# Most elements of one explicit score tensor (softcap / sinks) of a prefill chunk: 64 MiB
# in float32; longer chunks attend in slices of queries.
_SCORES = 2**24
# Fewest queries in one SDPA call of a sliding-window chunk that attends in slices: a chunk
# of at least two slices' length (and at least two windows) attends slice by slice, each
# over the keys its queries can see, not over the whole band's square.
_WINDOW_SLICE = 256


@dataclass(frozen=True)
class DecodeRows:
    """The one-token sequences of a batch, as one attention cache group sees them."""

    tokens: torch.Tensor | None  # [S] their tokens in the flattened batch; None: all, in order
    blocks: torch.Tensor  # [S] the block each new K/V goes to
    slots: torch.Tensor  # [S] its slot in that block
    read: torch.Tensor  # [S * W] the blocks to gather, row after row (padded with block 0)
    lo: torch.Tensor  # [S] int32: the first visible of a row's W * B slots (a run to hi)
    hi: torch.Tensor  # [S] int32: the last (the new token's own)
    row_slots: int  # W * B

    # The gather path's mask, built on first use (the CPU kernel reads lo and hi only).
    @functools.cached_property
    def visible(self) -> torch.Tensor:
        """[S, 1, 1, W * B] bool: the gathered slots each row's query may see."""
        slot = torch.arange(self.row_slots, device=self.lo.device)
        return ((slot >= self.lo[:, None]) & (slot <= self.hi[:, None]))[:, None, None, :]

    @functools.cached_property
    def masked(self) -> torch.Tensor | None:
        """Flat indices in [S * W * B] of the slots no query sees (None: none)."""
        masked = (~self.visible).flatten().nonzero().flatten()
        return masked if masked.numel() else None


@dataclass(frozen=True)
class SeqPlan:
    """One multi-token sequence, as one attention cache group sees it."""

    seq: SeqInfo
    blocks: torch.Tensor  # [n] the block each new token's K/V goes to
    slots: torch.Tensor  # [n] its slot in that block
    read: torch.Tensor  # the blocks that hold keys first_key .. num_tokens - 1
    offset: int  # first_key's index in the gathered run of slots
    causal: bool  # visible is the plain causal square: the chunk starts the sequence
    window: int | None  # the sliding window, where the chunk attends in slices of queries
    own_key: int  # the first query's own key: its index in the gathered run (from first_key)
    lo: torch.Tensor  # [n] int32: each query's first visible key, as an index like own_key
    limits: tuple[int | None, int | None]  # the layer's (window, chunk), for `visible`

    # The PyTorch path's mask, built on first use (the CPU kernel reads lo and own_key only).
    @functools.cached_property
    def visible(self) -> torch.Tensor:
        """[n, num_tokens - first_key] bool: the keys each query may see."""
        seq, dev = self.seq, self.lo.device
        pos = torch.arange(seq.num_computed, seq.num_tokens, device=dev)
        kpos = torch.arange(seq.num_computed - self.own_key, seq.num_tokens, device=dev)
        return _visible(pos[:, None], kpos[None, :], *self.limits)


@dataclass(frozen=True)
class AttentionPlan:
    rows: DecodeRows | None
    loop: list[SeqPlan]


def paged_attention(
    layer_name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    *,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the batch's new tokens -> out [T, Hq, D]. Writes
    the new K/V into the layer's pages.

    `window`: each query sees itself and the window - 1 tokens before it. `chunk`: each
    query sees earlier tokens of its own chunk only. `sinks` [Hq]: per-head logits added
    to each softmax denominator (gpt-oss).
    """
    cache = batch.kv.attention_view(layer_name)  # [N, 2, B, Hkv, D]
    plan = attention_plan(layer_name, batch, window, chunk)
    rows = plan.rows
    if rows is not None and rows.tokens is None:
        return _attend_rows(q, k, v, cache, rows, scale, softcap, sinks)
    out = torch.empty_like(q)
    if rows is not None:
        t = rows.tokens
        out[t] = _attend_rows(q[t], k[t], v[t], cache, rows, scale, softcap, sinks)
    for p in plan.loop:
        s = p.seq
        a, b = s.start, s.end
        out[a:b] = _attend_seq(q[a:b], k[a:b], v[a:b], cache, p, scale, softcap, sinks)
    return out


def attention_plan(
    layer_name: str, batch: ForwardBatch, window: int | None, chunk: int | None
) -> AttentionPlan:
    """The step's index tensors for the layer's cache group (built by its first layer)."""
    group_id = batch.kv.config.group_of(layer_name).group_id
    key = ("attention", group_id, window, chunk)
    plan = batch.memo.get(key)
    if plan is None:
        plan = batch.memo[key] = _plan(batch, group_id, window, chunk)
    return plan


def _plan(batch: ForwardBatch, group_id: int, window, chunk) -> AttentionPlan:
    bs = batch.kv.config.block_size
    dev = batch.kv.device
    singles = [s for s in batch.seqs if s.num_new == 1]
    if len(singles) < MIN_DECODE_ROWS:
        singles = []
    rest = [s for s in batch.seqs if s.num_new != 1] if singles else batch.seqs
    rows = None
    if singles:
        rows = _decode_rows(singles, group_id, bs, window, chunk, dev, whole=not rest)
    loop = [_seq_plan(s, s.block_ids[group_id], bs, window, chunk, dev) for s in rest]
    return AttentionPlan(rows, loop)


def _decode_rows(seqs: list[SeqInfo], group_id, bs, window, chunk, dev, whole) -> DecodeRows:
    pos = [s.num_computed for s in seqs]
    tables = [s.block_ids[group_id] for s in seqs]
    low = [_first_key(p, window, chunk) for p in pos]
    first = [k // bs for k in low]
    width = max(p // bs - f + 1 for p, f in zip(pos, first, strict=True))
    read: list[int] = []
    for table, f, p in zip(tables, first, pos, strict=True):
        span = table[f : p // bs + 1]
        read += span
        read += [0] * (width - len(span))
    # a row sees one run of its gathered slots: from its first key to its own
    lo = torch.tensor([k - f * bs for k, f in zip(low, first, strict=True)], device=dev)
    hi = torch.tensor([p - f * bs for p, f in zip(pos, first, strict=True)], device=dev)
    return DecodeRows(
        tokens=None if whole else torch.tensor([s.start for s in seqs], device=dev),
        blocks=torch.tensor([t[p // bs] for t, p in zip(tables, pos, strict=True)], device=dev),
        slots=torch.tensor([p % bs for p in pos], device=dev),
        read=torch.tensor(read, device=dev),
        lo=lo.int(),
        hi=hi.int(),
        row_slots=width * bs,
    )


def _seq_plan(seq: SeqInfo, table: list[int], bs: int, window, chunk, dev) -> SeqPlan:
    pos = torch.arange(seq.num_computed, seq.num_tokens, device=dev)
    lo = _first_key(seq.num_computed, window, chunk)
    first, last = lo // bs, (seq.num_tokens - 1) // bs
    return SeqPlan(
        seq=seq,
        blocks=torch.tensor(table, dtype=torch.long, device=dev)[pos // bs],
        slots=pos % bs,
        read=torch.tensor(table[first : last + 1], dtype=torch.long, device=dev),
        offset=lo - first * bs,
        causal=seq.num_computed == 0
        and (window is None or seq.num_new <= window)
        and (chunk is None or seq.num_new <= chunk),
        window=window if window is not None and seq.num_new >= 2 * _slice(window) else None,
        own_key=seq.num_computed - lo,
        lo=(_first_keys(pos, window, chunk) - lo).to(torch.int32),
        limits=(window, chunk),
    )


def _slice(window: int) -> int:
    return max(window, _WINDOW_SLICE)


def _first_keys(pos: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """`_first_key` of each position in `pos`."""
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp_(min=0)
    return lo if chunk is None else torch.maximum(lo, pos // chunk * chunk)


def _visible(qpos, kpos, window: int | None, chunk: int | None) -> torch.Tensor:
    """Which key positions each query position may attend to (causal, window, chunk)."""
    allowed = kpos <= qpos
    if window is not None:
        allowed &= (qpos - kpos) < window
    if chunk is not None:
        allowed &= (kpos // chunk) == (qpos // chunk)
    return allowed


def _first_key(pos: int, window: int | None, chunk: int | None) -> int:
    """The first key position a query at `pos` sees: the run `_visible` allows ends at `pos`."""
    lo = 0 if window is None else max(0, pos - window + 1)
    return lo if chunk is None else max(lo, pos // chunk * chunk)


def _probs(scores, visible, softcap, sink) -> torch.Tensor:
    """Softmax weights (float32) of explicit scores [..., K]: softcap, mask, then `sink`
    (broadcastable to [..., 1], when given) joins each row's denominator and is dropped."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~visible, float("-inf"))
    if sink is None:
        return F.softmax(scores, dim=-1)
    sink = sink.float().expand(*scores.shape[:-1], 1)
    return F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _attend_rows(q, k, v, cache, rows: DecodeRows, scale, softcap, sinks) -> torch.Tensor:
    """One query per row: q [S, Hq, D], k/v [S, Hkv, D] -> [S, Hq, D]."""
    kc, vc = cache[:, 0], cache[:, 1]  # [N, B, Hkv, D] each
    kc[rows.blocks, rows.slots] = k.to(cache.dtype)
    vc[rows.blocks, rows.slots] = v.to(cache.dtype)
    out = cpu_kernels.decode_attention(q, cache, rows.read, rows.lo, rows.hi, scale, softcap, sinks)
    if out is not None:  # the keys read where they lie (CPU)
        return out
    n, hq, d = q.shape
    hkv = kc.shape[2]
    keys = kc.index_select(0, rows.read).to(q.dtype)  # [S * W, B, Hkv, D]
    values = vc.index_select(0, rows.read).to(q.dtype)
    if rows.masked is not None:
        keys.view(-1, hkv * d).index_fill_(0, rows.masked, 0)
        values.view(-1, hkv * d).index_fill_(0, rows.masked, 0)
    keys = keys.view(n, -1, hkv, d).transpose(1, 2)  # [S, Hkv, T, D]
    values = values.view(n, -1, hkv, d).transpose(1, 2)
    # the query heads that share a KV head are SDPA's query rows: GQA without repeats
    qg = q.reshape(n, hkv, hq // hkv, d)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=rows.visible, scale=scale)
    else:
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [S, Hkv, G, W*B]
        sink = None if sinks is None else sinks.reshape(hkv, hq // hkv, 1)
        probs = _probs(scores, rows.visible, softcap, sink)
        out = torch.matmul(probs.to(q.dtype), values)
    return out.reshape(n, hq, d)


def _attend_seq(q, k, v, cache, p: SeqPlan, scale, softcap, sinks) -> torch.Tensor:
    """One sequence's queries: q [n, Hq, D], k/v [n, Hkv, D] -> [n, Hq, D]."""
    cache[p.blocks, 0, p.slots] = k.to(cache.dtype)
    cache[p.blocks, 1, p.slots] = v.to(cache.dtype)
    out = cpu_kernels.prompt_attention(
        q, cache, p.read, p.offset, p.lo, p.own_key, scale, softcap, sinks
    )
    if out is not None:  # the keys read where they lie, only the visible ones (CPU)
        return out
    num_keys = p.visible.shape[1]
    kv = cache.index_select(0, p.read)  # [nb, 2, B, Hkv, D]
    kv = kv.transpose(0, 1).flatten(1, 2)[:, p.offset : p.offset + num_keys]
    hq, hkv = q.shape[1], kv.shape[2]
    if softcap is None and sinks is None:
        # SDPA's fused (flash) CPU kernel, GQA without repeating K/V. It needs a batch
        # dimension: given [H, n, D] CPU SDPA takes its unfused math path, 2.6x slower at
        # 256 tokens and 3.4x at 1,024. A chunk that starts its sequence is the plain causal
        # square, which the kernel skips by blocks (another 1.1-1.6x). Every query sees
        # itself, so no row is fully masked.
        q4 = q.transpose(0, 1)[None]
        k4 = kv[0].to(q.dtype).transpose(0, 1)[None]
        v4 = kv[1].to(q.dtype).transpose(0, 1)[None]
        gqa = hq != hkv
        if p.window is None:
            mask = None if p.causal else p.visible
            out = F.scaled_dot_product_attention(
                q4, k4, v4, attn_mask=mask, is_causal=p.causal, scale=scale, enable_gqa=gqa
            )  # [1, Hq, n, D]
            return out[0].transpose(0, 1)
        # A long sliding-window chunk: each slice of queries attends over the keys from its
        # first query's window start to its last query, not the whole chunk's keys.
        n = q.shape[0]
        out = q4.new_empty(q4.shape)
        step = _slice(p.window)
        for a in range(0, n, step):
            b = min(n, a + step)
            k0, k1 = max(0, p.own_key + a - p.window + 1), p.own_key + b
            out[:, :, a:b] = F.scaled_dot_product_attention(
                q4[:, :, a:b],
                k4[:, :, k0:k1],
                v4[:, :, k0:k1],
                attn_mask=p.visible[a:b, k0:k1],
                scale=scale,
                enable_gqa=gqa,
            )
        return out[0].transpose(0, 1)
    # explicit scores, [Hkv, G, n, K] for the query heads sharing a KV head: GQA without
    # repeats; queries in slices of at most _SCORES elements of scores
    n, d, g = q.shape[0], q.shape[2], hq // hkv
    keys, values = kv[0].to(q.dtype), kv[1].to(q.dtype)  # [K, Hkv, D]
    sink = None if sinks is None else sinks.reshape(hkv, g, 1, 1)
    qg = q.reshape(n, hkv, g, d)
    out = torch.empty_like(q)
    step = max(1, _SCORES // (hq * num_keys))
    for a in range(0, n, step):
        scores = torch.einsum("qhgd,khd->hgqk", qg[a : a + step], keys) * scale
        probs = _probs(scores, p.visible[a : a + step], softcap, sink).to(q.dtype)
        part = torch.einsum("hgqk,khd->qhgd", probs, values)
        out[a : a + step] = part.reshape(-1, hq, d)
    return out
