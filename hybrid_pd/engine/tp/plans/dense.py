"""Llama, Mistral, Qwen2, Qwen3 and Gemma 3."""

from __future__ import annotations

import copy

from hybrid_pd.engine.tp.plans.base import (
    TPPlan,
    attention_rules,
    attention_sizes,
    config_int,
    divide,
    gated_mlp_rules,
    text_config,
)
from hybrid_pd.engine.tp.shard import ParamRules


def plan(cfg: dict, size: int) -> TPPlan:
    """Llama, Mistral, Qwen2, Qwen3 and Gemma 3: attention + gated MLP per layer."""
    rank = copy.deepcopy(cfg)
    text = text_config(rank)
    heads, kv, head_dim = attention_sizes(text, size)
    inter = config_int(text, "intermediate_size")
    text["intermediate_size"] = divide("intermediate_size", inter, size)
    rules = attention_rules(r".*\.self_attn", heads, kv, head_dim) + gated_mlp_rules(
        r".*\.mlp", inter
    )
    return TPPlan(size, rank, ParamRules(rules), (r".*\.self_attn\.o_proj", r".*\.mlp\.down_proj"))
