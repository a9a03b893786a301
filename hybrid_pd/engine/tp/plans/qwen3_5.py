"""Qwen3.5 (dense and MoE) and Qwen3-Next."""

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
from hybrid_pd.engine.tp.shard import ParamRules, Seg, Split


def plan(cfg: dict, size: int) -> TPPlan:
    """Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet or gated attention per layer,
    a gated MLP or a MoE of stacked experts with a shared expert."""
    rank = copy.deepcopy(cfg)
    text = text_config(rank)
    heads, kv, head_dim = attention_sizes(text, size)
    k_heads = config_int(text, "linear_num_key_heads")
    v_heads = config_int(text, "linear_num_value_heads")
    dk, dv = config_int(text, "linear_key_head_dim"), config_int(text, "linear_value_head_dim")
    text["linear_num_key_heads"] = divide("linear_num_key_heads", k_heads, size)
    text["linear_num_value_heads"] = divide("linear_num_value_heads", v_heads, size)
    r = v_heads // k_heads
    vh = Seg(v_heads, dv)
    qkv = (Seg(k_heads, dk), Seg(k_heads, dk), vh)
    rules = attention_rules(r".*\.self_attn", heads, kv, head_dim, q_width=2 * head_dim)
    rules += (
        (r".*\.linear_attn\.in_proj_qkv\.weight", Split(0, qkv)),
        (r".*\.linear_attn\.in_proj_z\.weight", Split(0, (vh,))),
        (r".*\.linear_attn\.in_proj_[ba]\.weight", Split(0, (Seg(v_heads),))),
        # Qwen3-Next's fused projections, grouped per key head
        (
            r".*\.linear_attn\.in_proj_qkvz\.weight",
            Split(0, (Seg(k_heads, 2 * dk + 2 * r * dv),)),
        ),
        (r".*\.linear_attn\.in_proj_ba\.weight", Split(0, (Seg(k_heads, 2 * r),))),
        (r".*\.linear_attn\.conv1d\.(weight|bias)", Split(0, qkv)),
        (r".*\.linear_attn\.(dt_bias|A_log)", Split(0, (Seg(v_heads),))),
        (r".*\.linear_attn\.out_proj\.weight", Split(1, (vh,))),
    )
    # a layer's whole MLP: a gated MLP's down projection, or a MoE block with its shared expert
    reduce = (r".*\.self_attn\.o_proj", r".*\.linear_attn\.out_proj", r".*\.mlp")
    if text.get("intermediate_size") is not None:
        inter = config_int(text, "intermediate_size")
        text["intermediate_size"] = divide("intermediate_size", inter, size)
        rules += gated_mlp_rules(r".*\.mlp", inter)
    if int(text.get("num_experts") or 0) > 0:
        moe = config_int(text, "moe_intermediate_size")
        shared = config_int(text, "shared_expert_intermediate_size")
        text["moe_intermediate_size"] = divide("moe_intermediate_size", moe, size)
        text["shared_expert_intermediate_size"] = divide(
            "shared_expert_intermediate_size", shared, size
        )
        rules += (
            (r".*\.mlp\.(gate|up)_proj", Split(1, (Seg(moe),))),
            (r".*\.mlp\.down_proj", Split(2, (Seg(moe),))),
            *gated_mlp_rules(r".*\.mlp\.shared_expert", shared),
        )
    return TPPlan(size, rank, ParamRules(rules), reduce)
