"""Llama 4 (text)."""

from __future__ import annotations

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import ParamRules, Seg, Split


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Llama 4: chunked local (RoPE) or global (NoPE) attention, query heads split (the L2
    q / k norm and the temperature tuning act per head, weightless); a MoE (stacked experts
    [E, gate rows | up rows, hidden] and [E, hidden, I], plus a shared SwiGLU expert of the
    same width) or a dense SwiGLU MLP of ``intermediate_size_mlp``, each split by width and
    all-reduced once as a whole feed-forward block. The router stays whole."""
    rank, text = base.rank_config(cfg)
    # Llama4TextConfig's defaults (head_dim 128, 8 KV heads) before the generic rules
    text.setdefault("head_dim", 128)
    text.setdefault("num_key_value_heads", 8)
    rules, _ = base.split_attention(text, size)
    inter = base.split_width(text, "intermediate_size", size, 8192)
    mlp = base.split_width(text, "intermediate_size_mlp", size, 16384)
    rules += base.gated_mlp_rules(r".*\.feed_forward\.shared_expert", inter)
    rules += base.gated_mlp_rules(r".*\.feed_forward", mlp)
    rules += (
        (r".*\.feed_forward\.experts\.gate_up_proj", Split(1, (Seg(inter), Seg(inter)))),
        (r".*\.feed_forward\.experts\.down_proj", Split(2, (Seg(inter),))),
    )
    return base.TPPlan(
        size, rank, ParamRules(rules), (r".*\.self_attn\.o_proj", r".*\.feed_forward")
    )
