"""How a tensor of the whole model becomes one rank's shard.

A sharded dimension is a run of segments; each segment is `units` heads (or groups, or
channels) of `width` rows or columns. A rank takes its share of every segment's units,
in order, so a fused projection ([z | x | B | C | dt] rows of a Mamba2 in_proj, say) splits
each part by its own unit:

    rows of in_proj:  | z: H x P | x: H x P | B: G x N | C: G x N | dt: H x 1 |
    rank 0 of 2:      | z[:H/2]  | x[:H/2]  | B[group] | C[group] | dt[:H/2]  |

Units split evenly when the ranks divide them. A segment marked `replicate` (KV heads,
Mamba2 B / C groups) may have fewer units than ranks, when the ranks are a multiple of
them: each unit then goes whole to size / units consecutive ranks (rank r takes unit
r * units // size), which is the unit its query or value heads read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hybrid_pd.kvcache.tp_layout import rank_units


@dataclass(frozen=True)
class Seg:
    """`units` units of `width` entries each along the sharded dimension."""

    units: int
    width: int = 1
    replicate: bool = False


@dataclass(frozen=True)
class Split:
    """Shard dimension `dim` (0: a linear's output rows, column-parallel; 1: its input
    columns, row-parallel) segment by segment."""

    dim: int
    segs: tuple[Seg, ...]


#: A row-parallel layer's bias: every rank's partial sum would add it once, so rank 0
#: keeps it and the others hold zeros.
LEADER_ONLY = "leader-only"

Rule = Split | str


#: The units of a segment that `rank` of `size` holds (ValueError when it cannot split so):
#: the same rule the KV pools' shards follow (`kvcache.tp_layout`).
owned_units = rank_units


def shard_tensor(tensor: torch.Tensor, rule: Rule, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of `tensor` (a new contiguous tensor)."""
    if rule == LEADER_ONLY:
        return tensor.clone() if rank == 0 else torch.zeros_like(tensor)
    assert isinstance(rule, Split)
    total = sum(s.units * s.width for s in rule.segs)
    if tensor.shape[rule.dim] != total:
        raise ValueError(
            f"dimension {rule.dim} has {tensor.shape[rule.dim]} entries, the split expects {total}"
        )
    pieces, start = [], 0
    for seg in rule.segs:
        mine = owned_units(seg.units, size, rank, seg.replicate)
        first, count = start + mine.start * seg.width, len(mine) * seg.width
        pieces.append(tensor.narrow(rule.dim, first, count))
        start += seg.units * seg.width
    return torch.cat(pieces, dim=rule.dim).contiguous()


@dataclass(frozen=True)
class ParamRules:
    """Parameter-name patterns (`re.fullmatch`) -> rules; parameters no pattern names are
    replicated (embeddings, norms of the hidden size, routers, the head)."""

    rules: tuple[tuple[str, Rule], ...]

    def rule_for(self, name: str) -> Rule | None:
        for pattern, rule in self.rules:
            if re.fullmatch(pattern, name):
                return rule
        return None
