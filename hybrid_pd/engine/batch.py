"""What one forward step sees: the flattened tokens and, per sequence, its cache blocks.

    input_ids:  [ seq0 new tokens | seq1 new tokens | ... ]      (T tokens in all)
    seqs[i]:    start, num_new, num_computed, block_ids (one list per KV cache group)

Sequence i's new tokens are positions num_computed .. num_computed + num_new - 1. Its cache
already holds positions 0 .. num_computed - 1 (what its layers still need of them).

A sequence may carry a `snapshot`: its recurrent states after its first k new tokens go to
other pages as well (the prefix cache keeps them). State layers then run it in two pieces
(`SeqInfo.pieces`): the first k tokens write the snapshot pages, the rest start from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_pd.kvcache.pool import KVPool


@dataclass(frozen=True)
class SeqInfo:
    request_id: str
    start: int
    num_new: int
    num_computed: int
    block_ids: tuple[list[int], ...]
    #: (k, block ids per group): the states after the first k new tokens go to these pages.
    snapshot: tuple[int, tuple[list[int], ...]] | None = None
    #: Where a piece reads its states from (None: `block_ids`, where it writes them).
    read_ids: tuple[list[int], ...] | None = None
    #: The second piece of a split sequence: it runs after the first (which it reads).
    tail: bool = False

    def pieces(self, group_id: int) -> list[SeqInfo]:
        """What a layer of state group `group_id` runs: this sequence, or, with a snapshot
        for that group, its first k tokens (reading its pages, writing the snapshot's) and
        then the rest (the other way)."""
        if self.snapshot is None or not self.snapshot[1][group_id]:
            return [self]
        k, pages = self.snapshot
        head = SeqInfo(
            self.request_id, self.start, k, self.num_computed, pages, read_ids=self.block_ids
        )
        rest = SeqInfo(
            self.request_id,
            self.start + k,
            self.num_new - k,
            self.num_computed + k,
            self.block_ids,
            read_ids=pages,
            tail=True,
        )
        return [head, rest]

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def num_tokens(self) -> int:
        """Tokens in the cache once this step is done."""
        return self.num_computed + self.num_new


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqInfo]
    kv: KVPool
    # What layers derive from the batch alone (index tensors per cache group), built by the
    # first layer that needs it and shared by the rest of the step.
    memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Index in the flattened batch of each sequence's last new token."""
        return torch.tensor([s.end - 1 for s in self.seqs], device=self.input_ids.device)

    def block_table(self, layer_name: str, seq: SeqInfo) -> list[int]:
        return seq.block_ids[self.kv.config.group_of(layer_name).group_id]


def make_batch(
    kv: KVPool,
    seqs: list[tuple],
) -> ForwardBatch:
    """Build a batch from (request id, new token ids, num_computed, block ids[, snapshot])
    tuples (`SeqInfo.snapshot`)."""
    ids: list[int] = []
    pos: list[int] = []
    infos = []
    for rid, new_ids, computed, block_ids, *snapshot in seqs:
        snap = snapshot[0] if snapshot else None
        infos.append(SeqInfo(rid, len(ids), len(new_ids), computed, block_ids, snap))
        ids += new_ids
        pos += range(computed, computed + len(new_ids))
    dev = kv.device
    return ForwardBatch(
        torch.tensor(ids, dtype=torch.long, device=dev),
        torch.tensor(pos, dtype=torch.long, device=dev),
        infos,
        kv,
    )
