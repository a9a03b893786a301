"""Plain GQA self-attention over the paged pool, for hybrids whose attention layers have no
extras (Bamba, Nemotron-H, Falcon-H1): q/k/v/o projections, an optional key multiplier
(Falcon-H1's muP ``key_multiplier``, applied before RoPE), optional RoPE on the first
`rotary_dim` dims of each head (rotate-half layout), softmax scale head_dim^-0.5, causal over
every earlier token of the request.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.rope import norm_rotate
from hybrid_pd.engine.onednn import FusedLinears
from hybrid_pd.engine.paged_attention import paged_attention
from hybrid_pd.kvcache.specs import AttentionSpec, SlidingWindowSpec


def sliding_window(spec: AttentionSpec) -> int | None:
    """The window of a sliding-window layer's spec; None for any other attention."""
    return spec.window if isinstance(spec, SlidingWindowSpec) else None


def head_sizes(s: Any) -> dict[str, int]:
    """`AttentionProjections`' sizes, by name, from a model's settings that carry them
    under the same names (``hidden``, ``num_heads``, ``num_kv_heads``, ``head_dim``)."""
    return {
        "hidden": s.hidden,
        "num_heads": s.num_heads,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
    }


def project_heads(
    qkv: FusedLinears, x: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, num_heads, head_dim] and k, v [T, num_kv_heads, head_dim] of x [T, hidden]."""
    t = x.shape[0]
    q, k, v = qkv(x)
    return (
        q.view(t, num_heads, head_dim),
        k.view(t, num_kv_heads, head_dim),
        v.view(t, num_kv_heads, head_dim),
    )


class AttentionProjections(nn.Module):
    """An attention layer's q / k / v / o projections, checkpoint names q_proj, k_proj,
    v_proj, o_proj (q, k and v run as one GEMM). `o_bias`: the output projection's bias
    when it differs from `bias`; `q_per_head`: query rows per head in head_dims (2 where a
    gate rides with each query head, Qwen3.5)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool = False,
        o_bias: bool | None = None,
        q_per_head: int = 1,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden, q_out * q_per_head, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_out, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=bias if o_bias is None else o_bias)
        self._qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, num_heads, head_dim] and k, v [T, num_kv_heads, head_dim] of x [T, hidden]."""
        return project_heads(self._qkv, x, self.num_heads, self.num_kv_heads, self.head_dim)


class RotaryAttention(AttentionProjections):
    """Attention over the layer's (cos, sin) tables: q and k each through an optional
    per-head norm (`q_norm`, `k_norm`) and RoPE (`rope.norm_rotate`), a sliding `window` or
    none, optional per-head `sinks` (gpt-oss); the layer is ``model.layers.{layer_idx}``.
    A subclass sets the norms or sinks after this constructor (None here); `projections`
    are `AttentionProjections`' arguments, by name."""

    def __init__(
        self, layer_idx: int, *, scale: float, window: int | None, **projections: Any
    ) -> None:
        super().__init__(**projections)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.sinks: torch.Tensor | None = None
        self.layer_name = f"model.layers.{layer_idx}"
        self.scale = scale
        self.window = window

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(x)
        q, k = norm_rotate(q, cos, sin, self.q_norm), norm_rotate(k, cos, sin, self.k_norm)
        out = paged_attention(
            self.layer_name, q, k, v, batch, scale=self.scale, window=self.window, sinks=self.sinks
        )
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class PagedSelfAttention(AttentionProjections):
    """Checkpoint names: q_proj, k_proj, v_proj, o_proj. `spec` is the layer's cache spec:
    the KV heads and head dim come from it, so attention reads what the cache keeps."""

    def __init__(
        self,
        name: str,
        hidden: int,
        num_heads: int,
        spec: AttentionSpec,
        *,
        bias: bool = False,
        rotary_dim: int = 0,
        key_multiplier: float = 1.0,
    ) -> None:
        if num_heads % spec.num_kv_heads:
            raise ValueError(
                f"{name}: {num_heads} attention heads are not a multiple of "
                f"{spec.num_kv_heads} KV heads"
            )
        if rotary_dim % 2 or rotary_dim > spec.head_dim:
            raise ValueError(f"{name}: rotary dim {rotary_dim} does not fit head dim")
        super().__init__(hidden, num_heads, spec.num_kv_heads, spec.head_dim, bias=bias)
        self.name = name
        self.rotary_dim = rotary_dim
        self.key_multiplier = key_multiplier
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, hidden]; `cos_sin` [T, 1, rotary_dim] each when the layer rotates."""
        t = x.shape[0]
        q, k, v = self.project(x)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if self.rotary_dim:
            cos, sin = cos_sin
            q, k = norm_rotate(q, cos, sin), norm_rotate(k, cos, sin)
        out = paged_attention(self.name, q, k, v, batch, scale=self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
