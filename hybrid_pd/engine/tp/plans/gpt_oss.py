"""gpt-oss."""

from __future__ import annotations

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import LEADER_ONLY, ParamRules, Seg, Split


def plan(cfg: dict, size: int) -> base.TPPlan:
    """gpt-oss: sliding or full attention with biases and a learned sink per query head (the
    sinks split with their heads), and a top-k MoE of clamped-SwiGLU experts with biases.
    Every expert splits its width: gate_up ([E, gate rows | up rows, hidden] after the load
    undoes the interleaving) and its bias by rows, down ([E, hidden, I]) by columns; the
    down bias is rank 0's alone (the router weight scales it on rank 0 only, so it is
    added once); the whole MoE block is all-reduced. The router stays whole."""
    rank, text = base.rank_config(cfg)
    rules, heads = base.split_attention(text, size)
    inter = base.split_width(text, "intermediate_size", size, 2880)
    gate_up = (Seg(inter), Seg(inter))
    rules += (
        (r".*\.self_attn\.sinks", Split(0, (Seg(heads),))),
        (r".*\.mlp\.experts\.gate_up_proj(_bias)?", Split(1, gate_up)),
        (r".*\.mlp\.experts\.down_proj", Split(2, (Seg(inter),))),
        (r".*\.mlp\.experts\.down_proj_bias", LEADER_ONLY),
    )
    return base.TPPlan(size, rank, ParamRules(rules), (r".*\.self_attn\.o_proj", r".*\.mlp"))
