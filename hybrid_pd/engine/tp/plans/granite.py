"""Granite-4.0-H."""

from __future__ import annotations

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import ParamRules, Seg, Split


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Granite-4.0-H: attention or Mamba2 per layer, a shared MLP and optional MoE."""
    rank, text = base.rank_config(cfg)
    rules, _ = base.split_attention(text, size)
    mamba, groups, inner = base.split_mamba2_expand(text, size, r".*\.mamba")
    rules += mamba
    # the shared MLP's and the MoE's partial sums added first, then all-reduced once
    reduce = (r".*\.self_attn\.o_proj", r".*\.mamba\.out_proj", r".*\.feed_forward_sum")
    shared = base.split_width(text, "shared_intermediate_size", size, 1024)
    rules += (
        (r".*\.shared_mlp\.input_linear\.weight", Split(0, (Seg(shared), Seg(shared)))),
        (r".*\.shared_mlp\.output_linear\.weight", Split(1, (Seg(shared),))),
    )
    if int(text.get("num_local_experts") or 0) > 0:
        inter = base.split_width(text, "intermediate_size", size)
        rules += (
            (r".*\.block_sparse_moe\.input_linear\.weight", Split(1, (Seg(inter), Seg(inter)))),
            (r".*\.block_sparse_moe\.output_linear\.weight", Split(2, (Seg(inter),))),
        )
    patch = base.span_mamba2_norms(groups, inner) if groups < size else None
    return base.TPPlan(size, rank, ParamRules(rules), reduce, patch)
