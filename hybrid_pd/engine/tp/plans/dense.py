"""Llama, Mistral, Qwen2, Qwen3 and Gemma 3."""

from __future__ import annotations

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import ParamRules


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Llama, Mistral, Qwen2, Qwen3 and Gemma 3: attention + gated MLP per layer."""
    rank, text = base.rank_config(cfg)
    rules, _ = base.split_attention(text, size)
    rules += base.gated_mlp_rules(r".*\.mlp", base.split_width(text, "intermediate_size", size))
    return base.TPPlan(
        size, rank, ParamRules(rules), (r".*\.self_attn\.o_proj", r".*\.mlp\.down_proj")
    )
