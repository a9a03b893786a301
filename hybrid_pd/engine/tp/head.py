"""The LM head split by vocabulary rows across a tensor-parallel group.

Every rank keeps the whole head (it is often the embedding too), but computes the logits
of its own run of vocabulary rows only, the model's scaling or capping included; rank 0
gathers the runs (`TPGroup.gather_columns`: copied out of the others' shared-memory slots,
nothing added), bit for bit what each rank computed. Only rank 0 samples, so only rank 0
gets the whole vocabulary. At a real vocabulary the head is a large share of the weights a
decode step reads (Granite-4.0-H-350M-like: 77M of 345M parameters): computed by rank 0
alone it made a TP-2 decode slower than TP 1.

The head runs on rows rank 0 picks after the forward pass (the sampled rows, prompt
slices for prompt logprobs), so rank 0 first tells the others which (`HeadRows`, through
the group's broadcast); the other ranks hold the step's hidden states, identical on every
rank after the last all-reduce and the replicated final norm.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_pd.engine.onednn import PackedWeights, packed_linear
from hybrid_pd.engine.tp.group import TPGroup

Index = slice | list[int]


@dataclass(frozen=True)
class HeadRows:
    """Rank 0's word to the other ranks: run the head on these rows of this step's hidden
    states, now."""

    index: Index


class VocabShard:
    """This rank's run of the head's rows: rows [r * V // size, (r + 1) * V // size) of a
    head of V rows (the vocabulary need not divide by the group's size)."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.vocab = 0  # the head's rows, known from its first product
        self._packs = PackedWeights()

    def rows(self, vocab: int) -> tuple[int, int]:
        return self._rows_of(self.group.rank, vocab)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's run of `hidden @ weight.T`: [..., hi - lo]."""
        self.vocab = weight.shape[0]
        lo, hi = self.rows(self.vocab)
        mine = weight[lo:hi]  # rows of a row-major weight: one contiguous block
        return packed_linear(hidden, mine, self._packs.get("head", mine))

    def gather(self, part: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the whole vocabulary's logits from every rank's `part` (a model's
        `compute_logits` of the same rows: its scaling or capping already applied, each
        rank to its own run); the other ranks: None."""
        columns = [self._rows_of(r, self.vocab) for r in range(self.group.size)]
        width = columns[self.group.rank][1] - columns[self.group.rank][0]
        whole = self.group.gather_columns(part.reshape(-1, width), columns)
        return None if whole is None else whole.view(*part.shape[:-1], self.vocab)

    def _rows_of(self, rank: int, vocab: int) -> tuple[int, int]:
        size = self.group.size
        return rank * vocab // size, (rank + 1) * vocab // size


def head_logits(
    model, hidden: torch.Tensor, weight: torch.Tensor, whole: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The head's logits: `whole(hidden)` (the model's own product with `weight`) in one
    process; where the model holds a `vocab_shard`, this rank's run of them only. A model's
    `compute_logits` calls this for the product, then applies its own scaling or capping
    (element by element, so each rank applies it to its run, side by side)."""
    shard: VocabShard | None = getattr(model, "vocab_shard", None)
    return whole(hidden) if shard is None else shard.logits(hidden, weight)


#: Heads smaller than this many weights stay whole on rank 0 (16 MB in float32: under a
#: millisecond a row on one core), where splitting would only add a gather to every step;
#: env HYBRID_PD_TP_HEAD_SPLIT_MIN (the followers inherit rank 0's environment).
MIN_SPLIT_WEIGHTS = 1 << 22


def install_vocab_shard(model, group: TPGroup, config: dict) -> None:
    """Split `model`'s head across `group` (nothing at size 1, nor for a head under
    MIN_SPLIT_WEIGHTS by `config`'s vocab_size x hidden_size, its text_config's where it
    has one)."""
    text = config.get("text_config") or config
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    least = int(os.environ.get("HYBRID_PD_TP_HEAD_SPLIT_MIN", MIN_SPLIT_WEIGHTS))
    small = vocab is not None and hidden is not None and vocab * hidden < least
    if group.size > 1 and not small:
        model.vocab_shard = VocabShard(group)


def leader_logits(model, group: TPGroup, hidden: torch.Tensor, index: Index) -> torch.Tensor:
    """Rank 0: the logits of `hidden[index]`, the other ranks told first to join in."""
    shard: VocabShard | None = getattr(model, "vocab_shard", None)
    if shard is None:
        return model.compute_logits(hidden[index])
    group.broadcast(HeadRows(index))
    return shard.gather(model.compute_logits(hidden[index]))


def follower_logits(model, hidden: torch.Tensor, rows: HeadRows) -> None:
    """A rank other than 0: its run of the logits of the rows rank 0 named, sent to rank 0."""
    model.vocab_shard.gather(model.compute_logits(hidden[rows.index]))
