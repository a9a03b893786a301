"""Reference (pure PyTorch) access to the paged pool from model layers.

Attention: write the step's K/V into their slots, gather the positions the step's queries
may read, attend with a causal (+ window / chunk) mask. State layers: read the request's
state page(s), update, write back. Sequences that add one token each are updated together
(`split_state_seqs`); the others loop over sequences. Projections stay batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybrid_pd.engine.batch import ForwardBatch, SeqInfo

# Fewest one-token sequences worth a batched state update (below it they join the loop).
MIN_STATE_ROWS = 1


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
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the batch's new tokens -> out [T, Hq, D].

    `window`: each query sees itself and the window - 1 tokens before it. `chunk`: each
    query sees earlier tokens of its own chunk only.
    """
    cache = batch.kv.attention_view(layer_name)  # [N, 2, B, Hkv, D]
    bs = cache.shape[2]
    if len(batch.seqs) > 1 and batch.num_tokens == len(batch.seqs):
        return _decode_batched(layer_name, q, k, v, batch, cache, scale, window, chunk, softcap)
    out = torch.empty_like(q)
    for seq in batch.seqs:
        table = batch.block_table(layer_name, seq)
        _write_kv(cache, table, bs, seq, k[seq.start : seq.end], v[seq.start : seq.end])
        lo = _first_key(seq.num_computed, window, chunk)
        keys, values = _gather_kv(cache, table, bs, lo, seq.num_tokens)
        qs = q[seq.start : seq.end]
        out[seq.start : seq.end] = _attend(qs, keys, values, seq, lo, scale, window, chunk, softcap)
    return out


def _decode_batched(
    layer_name, q, k, v, batch: ForwardBatch, cache, scale, window, chunk, softcap
) -> torch.Tensor:
    """One new token per sequence: write all K/V with one scatter, gather every sequence's
    readable blocks into one padded tensor, attend with a length mask."""
    bs = cache.shape[2]
    dev = cache.device
    tables = [batch.block_table(layer_name, s) for s in batch.seqs]
    pos = [s.num_computed for s in batch.seqs]
    blocks = torch.tensor([t[p // bs] for t, p in zip(tables, pos, strict=True)], device=dev)
    slots = torch.tensor([p % bs for p in pos], device=dev)
    cache[blocks, 0, slots] = k.to(cache.dtype)
    cache[blocks, 1, slots] = v.to(cache.dtype)
    first = [_first_key(p, window, chunk) // bs for p in pos]
    spans = [t[f : p // bs + 1] for t, f, p in zip(tables, first, pos, strict=True)]
    width = max(len(sp) for sp in spans)
    ids = torch.tensor([sp + [0] * (width - len(sp)) for sp in spans], device=dev)
    kv = cache[ids]  # [S, width, 2, B, Hkv, D]
    keys = kv[:, :, 0].flatten(1, 2).to(q.dtype)  # [S, width*B, Hkv, D]
    values = kv[:, :, 1].flatten(1, 2).to(q.dtype)
    qpos = torch.tensor(pos, device=dev)[:, None]
    kpos = torch.tensor(first, device=dev)[:, None] * bs + torch.arange(width * bs, device=dev)
    allowed = _visible(qpos, kpos, window, chunk)
    n, hq, d = q.shape
    hkv = keys.shape[2]
    qg = q.view(n, hkv, hq // hkv, d)
    scores = torch.einsum("sgrd,stgd->sgrt", qg, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("sgrt,stgd->sgrd", probs, values).reshape(n, hq, d)


def _visible(qpos, kpos, window: int | None, chunk: int | None) -> torch.Tensor:
    """Which key positions each query position may attend to (causal, window, chunk)."""
    allowed = kpos <= qpos
    if window is not None:
        allowed &= (qpos - kpos) < window
    if chunk is not None:
        allowed &= (kpos // chunk) == (qpos // chunk)
    return allowed


def _first_key(num_computed: int, window: int | None, chunk: int | None) -> int:
    if window is not None:
        return max(0, num_computed - window + 1)
    if chunk is not None:
        return (num_computed // chunk) * chunk
    return 0


def _write_kv(cache, table, bs, seq: SeqInfo, k, v) -> None:
    pos = torch.arange(seq.num_computed, seq.num_tokens)
    blocks = torch.tensor(table, dtype=torch.long)[pos // bs].to(cache.device)
    slots = (pos % bs).to(cache.device)
    cache[blocks, 0, slots] = k.to(cache.dtype)
    cache[blocks, 1, slots] = v.to(cache.dtype)


def _gather_kv(cache, table, bs, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    first, last = lo // bs, (hi - 1) // bs
    ids = torch.tensor(table[first : last + 1], dtype=torch.long, device=cache.device)
    kv = cache.index_select(0, ids)  # [nb, 2, B, H, D]
    kv = kv.transpose(0, 1).flatten(1, 2)  # [2, nb*B, H, D]
    off = lo - first * bs
    return kv[0, off : off + hi - lo], kv[1, off : off + hi - lo]


def _attend(q, keys, values, seq: SeqInfo, lo, scale, window, chunk, softcap):
    hq = q.shape[1]
    hkv = keys.shape[1]
    qpos = torch.arange(seq.num_computed, seq.num_tokens, device=q.device)[:, None]
    kpos = torch.arange(lo, seq.num_tokens, device=q.device)[None, :]
    allowed = _visible(qpos, kpos, window, chunk)
    keys = keys.to(q.dtype).repeat_interleave(hq // hkv, dim=1)
    values = values.to(q.dtype).repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, values)


def read_state(layer_name: str, batch: ForwardBatch, seq: SeqInfo) -> list[torch.Tensor]:
    """The sequence's state tensors for this layer (zeros for a fresh sequence)."""
    kv = batch.kv
    table = batch.block_table(layer_name, seq)
    group = kv.config.group_of(layer_name)
    if group.blocks_per_state == 1:
        states = [view[table[0]] for view in kv.state_views(layer_name)]
        states = [s.clone() for s in states]
    else:
        states = kv.read_state(layer_name, table)
    if seq.num_computed == 0:
        states = [torch.zeros_like(s) for s in states]
    return states


def write_state(
    layer_name: str, batch: ForwardBatch, seq: SeqInfo, states: list[torch.Tensor]
) -> None:
    kv = batch.kv
    table = batch.block_table(layer_name, seq)
    if kv.config.group_of(layer_name).blocks_per_state == 1:
        for view, s in zip(kv.state_views(layer_name), states, strict=True):
            view[table[0]].copy_(s)
    else:
        kv.write_state(layer_name, table, states)


@dataclass(frozen=True)
class StateRows:
    """The sequences of a batch that add one token each, seen by one state cache group."""

    tokens: torch.Tensor  # [S] index of each one's token in the flattened batch
    blocks: torch.Tensor  # [S, blocks_per_state] each one's state block ids
    fresh: torch.Tensor  # [S] bool: no state yet (num_computed == 0), starts from zeros
    any_fresh: bool


def split_state_seqs(
    layer_name: str, batch: ForwardBatch
) -> tuple[StateRows | None, list[SeqInfo]]:
    """(the one-token sequences as `StateRows`, or None when too few; the sequences left
    for the per-sequence path). When the second is empty the rows are the whole batch in
    order: token i is sequence i's. Built once per step and cache group, shared by its layers.
    """
    group = batch.kv.config.group_of(layer_name)
    key = ("state_rows", group.group_id)
    found = batch.memo.get(key)
    if found is None:
        found = batch.memo[key] = _split(batch, group.group_id)
    return found


def _split(batch: ForwardBatch, group_id: int) -> tuple[StateRows | None, list[SeqInfo]]:
    singles = [s for s in batch.seqs if s.num_new == 1]
    if len(singles) < MIN_STATE_ROWS:
        return None, batch.seqs
    dev = batch.input_ids.device
    fresh = [s.num_computed == 0 for s in singles]
    rows = StateRows(
        tokens=torch.tensor([s.start for s in singles], device=dev),
        blocks=torch.tensor([s.block_ids[group_id] for s in singles], device=dev),
        fresh=torch.tensor(fresh, device=dev),
        any_fresh=any(fresh),
    )
    return rows, [s for s in batch.seqs if s.num_new != 1]


def read_state_rows(layer_name: str, batch: ForwardBatch, rows: StateRows) -> list[torch.Tensor]:
    """[S, *shape] copies of the rows' state tensors for this layer (zeros for fresh rows)."""
    states = batch.kv.gather_states(layer_name, rows.blocks)
    if rows.any_fresh:
        for s in states:
            s.masked_fill_(rows.fresh.view(-1, *(1,) * (s.dim() - 1)), 0)
    return states


def write_state_rows(
    layer_name: str, batch: ForwardBatch, rows: StateRows, states: list[torch.Tensor]
) -> None:
    """Store [S, *shape] states (any float dtype; converted to the pool's) for the rows."""
    batch.kv.scatter_states(layer_name, rows.blocks, states)
