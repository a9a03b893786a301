"""Falcon-H1."""

from __future__ import annotations

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import ParamRules


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Falcon-H1: attention and a Mamba2 mixer side by side in every layer, then a gated MLP.

    The muP multipliers are scalars, and the in_proj's muP vector is one scalar per part
    (z, x, B, C, dt), rebuilt by the rank model from its own sizes. The Mamba2 inner size is
    ``mamba_d_ssm`` (``mamba_expand * hidden`` when null); with ``mamba_rms_norm`` the
    gated norm is per group of B/C (after the gate, or before it with
    ``mamba_norm_before_gate``), and a group spans ranks when there are fewer groups than
    ranks."""
    rank, text = base.rank_config(cfg)
    rules, _ = base.split_attention(text, size)
    hidden = base.config_int(text, "hidden_size")
    inner = text.get("mamba_d_ssm", 1024)
    inner = int(float(text.get("mamba_expand") or 2) * hidden) if inner is None else int(inner)
    m_heads, m_head_dim, groups, state = base.mamba2_heads(text, size, inner)
    text["mamba_d_ssm"] = m_head_dim * text["mamba_n_heads"]
    inter = base.split_width(text, "intermediate_size", size, 14336)
    rules += base.mamba2_rules(r".*\.mamba", m_heads, m_head_dim, groups, state)
    rules += base.gated_mlp_rules(r".*\.feed_forward", inter)
    reduce = (r".*\.self_attn\.o_proj", r".*\.mamba\.out_proj", r".*\.feed_forward\.down_proj")
    patch = None
    if groups < size and text.get("mamba_rms_norm"):
        before = text.get("mamba_norm_before_gate")
        patch = base.span_mamba2_norms(
            groups, inner, before_gate=True if before is None else before
        )
    return base.TPPlan(size, rank, ParamRules(rules), reduce, patch)
