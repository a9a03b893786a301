"""Reference (pure PyTorch) access to the paged pool from state layers (Mamba2, GDN):
read the request's state page(s), update, write back. Sequences that add one token each
are updated together (`split_state_seqs`); the others loop over sequences, a sequence that
keeps a snapshot inside its chunk as two pieces (`SeqInfo.pieces`). Projections stay batched.
Attention is in `paged_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.batch import ForwardBatch, SeqInfo

# Fewest one-token sequences worth a batched state update (below it they join the loop).
MIN_STATE_ROWS = 1


def read_state(layer_name: str, batch: ForwardBatch, seq: SeqInfo) -> list[torch.Tensor]:
    """The sequence's state tensors for this layer (zeros for a fresh sequence)."""
    kv = batch.kv
    group = kv.config.group_of(layer_name)
    table = (seq.read_ids or seq.block_ids)[group.group_id]
    if group.blocks_per_state == 1:
        kv.flush_rows(table[:1])
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
        kv.flush_rows(table[:1])
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


def state_rounds(seqs: list[SeqInfo]) -> list[list[SeqInfo]]:
    """`seqs` (from `split_state_seqs`) in the rounds a layer that updates several
    sequences at once must keep: the second pieces of split sequences after the rest."""
    tails = [s for s in seqs if s.tail]
    if not tails:
        return [seqs]
    return [[s for s in seqs if not s.tail], tails]


def _split(batch: ForwardBatch, group_id: int) -> tuple[StateRows | None, list[SeqInfo]]:
    singles = [s for s in batch.seqs if s.num_new == 1]
    if len(singles) < MIN_STATE_ROWS:
        return None, [p for s in batch.seqs for p in s.pieces(group_id)]
    dev = batch.input_ids.device
    fresh = [s.num_computed == 0 for s in singles]
    rows = StateRows(
        tokens=torch.tensor([s.start for s in singles], device=dev),
        blocks=torch.tensor([s.block_ids[group_id] for s in singles], device=dev),
        fresh=torch.tensor(fresh, device=dev),
        any_fresh=any(fresh),
    )
    return rows, [p for s in batch.seqs if s.num_new != 1 for p in s.pieces(group_id)]


def read_state_rows(layer_name: str, batch: ForwardBatch, rows: StateRows) -> list[torch.Tensor]:
    """[S, *shape] copies of the rows' state tensors for this layer (zeros for fresh rows)."""
    states = batch.kv.gather_states(layer_name, rows.blocks)
    if rows.any_fresh:
        for s in states:
            s.masked_fill_(rows.fresh.view(-1, *(1,) * (s.dim() - 1)), 0)
    return states


def state_rows_in_place(
    layer_name: str, batch: ForwardBatch, rows: StateRows
) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """(the pool's own [num_blocks, *shape] views of this layer's state tensors, the rows'
    block ids [S] int64) for kernels that update each row's state where it lies, fresh rows
    zeroed there first; None where a state spans several blocks (then `read_state_rows` /
    `write_state_rows`). Updating in place reads and writes each state once, where a
    gathered copy moves it three times (gather, update, scatter). Asked only where the kernels
    may take the rows (CPU, float32 states, the kernels built): elsewhere the layer's held
    rows stay held."""
    spec = batch.kv.config.group_of(layer_name).spec
    if rows.blocks.device.type != "cpu" or any(d != "float32" for d in spec.dtypes):
        return None
    if cpu_kernels.library() is None:
        return None
    views = batch.kv.state_views_in_place(layer_name)
    if views is None:
        return None
    ids = rows.blocks[:, 0]
    if rows.any_fresh:
        fresh = ids[rows.fresh]
        for view in views:
            view.index_fill_(0, fresh, 0)
    return views, ids


def write_state_rows(
    layer_name: str, batch: ForwardBatch, rows: StateRows, states: list[torch.Tensor]
) -> None:
    """Store [S, *shape] states (any float dtype; converted to the pool's) for the rows."""
    batch.kv.scatter_states(layer_name, rows.blocks, states)


def vec_times_rows(vec: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    """vec [S, G, n] times mat [S, G, n, m] -> [S, G, m], one bmm per g over the S rows.
    `mat` may be a view of state rows gathered from the pool (a row stride wider than one
    state), which one product over S * G would copy first (2-4x slower on CPU); a batch of
    [1, n] @ [n, m] also runs far faster there than matrix-times-vector forms."""
    ys = [torch.bmm(vec[:, g, None, :], mat[:, g]) for g in range(mat.shape[1])]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
