"""Bamba."""

from __future__ import annotations

import copy

from hybrid_pd.engine.tp.plans.base import (
    TPPlan,
    attention_rules,
    attention_sizes,
    config_int,
    divide,
    gated_mlp_rules,
    mamba2_expand_sizes,
    mamba2_rules,
    span_mamba2_norms,
    text_config,
)
from hybrid_pd.engine.tp.shard import ParamRules


def plan(cfg: dict, size: int) -> TPPlan:
    """Bamba: attention (at ``attn_layer_indices``) or Mamba2 per layer, then a gated MLP.
    Attention's partial RoPE (half of each head) is per head, so heads split as usual."""
    rank = copy.deepcopy(cfg)
    text = text_config(rank)
    heads, kv, head_dim = attention_sizes(text, size)
    m_heads, m_head_dim, groups, state, inner = mamba2_expand_sizes(text, size)
    inter = config_int(text, "intermediate_size", 14336)
    text["intermediate_size"] = divide("intermediate_size", inter, size)
    rules = attention_rules(r".*\.self_attn", heads, kv, head_dim)
    rules += mamba2_rules(r".*\.mamba", m_heads, m_head_dim, groups, state)
    rules += gated_mlp_rules(r".*\.feed_forward", inter)
    reduce = (r".*\.self_attn\.o_proj", r".*\.mamba\.out_proj", r".*\.feed_forward\.down_proj")
    patch = span_mamba2_norms(groups, inner) if groups < size else None
    return TPPlan(size, rank, ParamRules(rules), reduce, patch)
