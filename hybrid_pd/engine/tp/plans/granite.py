"""Granite-4.0-H."""

from __future__ import annotations

import copy

from hybrid_pd.engine.tp.plans.base import (
    TPPlan,
    attention_rules,
    attention_sizes,
    config_int,
    divide,
    mamba2_expand_sizes,
    mamba2_rules,
    span_mamba2_norms,
    text_config,
)
from hybrid_pd.engine.tp.shard import ParamRules, Seg, Split


def plan(cfg: dict, size: int) -> TPPlan:
    """Granite-4.0-H: attention or Mamba2 per layer, a shared MLP and optional MoE."""
    rank = copy.deepcopy(cfg)
    text = text_config(rank)
    heads, kv, head_dim = attention_sizes(text, size)
    m_heads, m_head_dim, groups, state, inner = mamba2_expand_sizes(text, size)
    rules = attention_rules(r".*\.self_attn", heads, kv, head_dim)
    rules += mamba2_rules(r".*\.mamba", m_heads, m_head_dim, groups, state)
    reduce = [r".*\.self_attn\.o_proj", r".*\.mamba\.out_proj", r".*\.shared_mlp"]
    shared = config_int(text, "shared_intermediate_size", 1024)
    text["shared_intermediate_size"] = divide("shared_intermediate_size", shared, size)
    rules += (
        (r".*\.shared_mlp\.input_linear\.weight", Split(0, (Seg(shared), Seg(shared)))),
        (r".*\.shared_mlp\.output_linear\.weight", Split(1, (Seg(shared),))),
    )
    if int(text.get("num_local_experts") or 0) > 0:
        inter = config_int(text, "intermediate_size")
        text["intermediate_size"] = divide("intermediate_size", inter, size)
        rules += (
            (r".*\.block_sparse_moe\.input_linear\.weight", Split(1, (Seg(inter), Seg(inter)))),
            (r".*\.block_sparse_moe\.output_linear\.weight", Split(2, (Seg(inter),))),
        )
        reduce.append(r".*\.block_sparse_moe")
    patch = span_mamba2_norms(groups, inner) if groups < size else None
    return TPPlan(size, rank, ParamRules(rules), tuple(reduce), patch)
