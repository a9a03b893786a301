"""Norms whose statistics span several ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SpannedGatedRMSNorm(nn.Module):
    """Mamba2's gated RMS norm (y * silu(z), normalised per group of `group_width`
    channels) where a group is wider than one rank's channels: with fewer groups than
    ranks (Granite-4.0-H's n_groups = 1) a group spans size / groups ranks. Each rank sums
    the squares of its channels; one all-reduce of a [tokens, groups] tensor, each rank
    adding into its own group's column, gives every rank its group's sum.

    `before_gate`: normalise y itself, apply the weight, then multiply by silu(z)
    (Falcon-H1's ``mamba_norm_before_gate``). Takes over the weight and eps of the rank's
    own norm (`local`)."""

    def __init__(
        self, local: nn.Module, group, groups: int, group_width: int, before_gate: bool = False
    ) -> None:
        super().__init__()
        self.weight = local.weight
        self.eps = local.eps
        self.tp = group
        self.groups = groups
        self.group_width = group_width
        self.before_gate = before_gate
        self.column = group.rank * groups // group.size

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() if self.before_gate else y.float() * F.silu(z.float())
        sums = h.new_zeros(h.shape[0], self.groups)
        sums[:, self.column] = h.pow(2).sum(-1)
        sums = self.tp.all_reduce(sums)
        scale = torch.rsqrt(sums[:, self.column, None] / self.group_width + self.eps)
        if self.before_gate:
            return (self.weight * (h * scale)) * F.silu(z.float())
        return self.weight * (h * scale).to(y.dtype)
