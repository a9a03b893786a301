"""Bamba."""

from __future__ import annotations

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import ParamRules


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Bamba: attention (at ``attn_layer_indices``) or Mamba2 per layer, then a gated MLP.
    Attention's partial RoPE (half of each head) is per head, so heads split as usual."""
    rank, text = base.rank_config(cfg)
    rules, _ = base.split_attention(text, size)
    mamba, groups, inner = base.split_mamba2_expand(text, size, r".*\.mamba")
    inter = base.split_width(text, "intermediate_size", size, 14336)
    rules += mamba + base.gated_mlp_rules(r".*\.feed_forward", inter)
    reduce = (r".*\.self_attn\.o_proj", r".*\.mamba\.out_proj", r".*\.feed_forward\.down_proj")
    patch = base.span_mamba2_norms(groups, inner) if groups < size else None
    return base.TPPlan(size, rank, ParamRules(rules), reduce, patch)
