"""Qwen3.5 (dense and MoE) and Qwen3-Next."""

from __future__ import annotations

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import ParamRules, Seg, Split


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet or gated attention per layer,
    a gated MLP or a MoE of stacked experts with a shared expert."""
    rank, text = base.rank_config(cfg)
    rules, _ = base.split_attention(text, size, gated_query=True)
    k_heads = base.config_int(text, "linear_num_key_heads")
    v_heads = base.config_int(text, "linear_num_value_heads")
    dk, dv = (
        base.config_int(text, "linear_key_head_dim"),
        base.config_int(text, "linear_value_head_dim"),
    )
    text["linear_num_key_heads"] = base.divide("linear_num_key_heads", k_heads, size)
    text["linear_num_value_heads"] = base.divide("linear_num_value_heads", v_heads, size)
    r = v_heads // k_heads
    vh = Seg(v_heads, dv)
    qkv = (Seg(k_heads, dk), Seg(k_heads, dk), vh)
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
        rules += base.gated_mlp_rules(r".*\.mlp", base.split_width(text, "intermediate_size", size))
    if int(text.get("num_experts") or 0) > 0:
        moe = base.split_width(text, "moe_intermediate_size", size)
        shared = base.split_width(text, "shared_expert_intermediate_size", size)
        rules += (
            (r".*\.mlp\.(gate|up)_proj", Split(1, (Seg(moe),))),
            (r".*\.mlp\.down_proj", Split(2, (Seg(moe),))),
            *base.gated_mlp_rules(r".*\.mlp\.shared_expert", shared),
        )
    return base.TPPlan(size, rank, ParamRules(rules), reduce)
