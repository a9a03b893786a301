"""Falcon-H1."""

from __future__ import annotations

import copy

from hybrid_pd.engine.tp.plans.base import (
    TPPlan,
    attention_rules,
    attention_sizes,
    config_int,
    divide,
    gated_mlp_rules,
    mamba2_rules,
    span_mamba2_norms,
    text_config,
)
from hybrid_pd.engine.tp.shard import ParamRules


def plan(cfg: dict, size: int) -> TPPlan:
    """Falcon-H1: attention and a Mamba2 mixer side by side in every layer, then a gated MLP.

    The muP multipliers are scalars, and the in_proj's muP vector is one scalar per part
    (z, x, B, C, dt), rebuilt by the rank model from its own sizes. The Mamba2 inner size is
    ``mamba_d_ssm`` (``mamba_expand * hidden`` when null); with ``mamba_rms_norm`` the
    gated norm is per group of B/C (after the gate, or before it with
    ``mamba_norm_before_gate``), and a group spans ranks when there are fewer groups than
    ranks."""
    rank = copy.deepcopy(cfg)
    text = text_config(rank)
    heads, kv, head_dim = attention_sizes(text, size)
    hidden = config_int(text, "hidden_size")
    m_heads = config_int(text, "mamba_n_heads", 128)
    groups = config_int(text, "mamba_n_groups", 1)
    state = config_int(text, "mamba_d_state", 256)
    inner = text.get("mamba_d_ssm", 1024)
    inner = int(float(text.get("mamba_expand") or 2) * hidden) if inner is None else int(inner)
    d_head = text.get("mamba_d_head", "auto")
    m_head_dim = inner // m_heads if d_head in (None, "auto") else int(d_head)
    text["mamba_n_heads"] = divide("mamba_n_heads", m_heads, size)
    text["mamba_n_groups"] = divide("mamba_n_groups", groups, size, replicate=True)
    text["mamba_d_head"] = m_head_dim
    text["mamba_d_ssm"] = m_head_dim * text["mamba_n_heads"]
    inter = config_int(text, "intermediate_size", 14336)
    text["intermediate_size"] = divide("intermediate_size", inter, size)
    rules = attention_rules(r".*\.self_attn", heads, kv, head_dim)
    rules += mamba2_rules(r".*\.mamba", m_heads, m_head_dim, groups, state)
    rules += gated_mlp_rules(r".*\.feed_forward", inter)
    reduce = (r".*\.self_attn\.o_proj", r".*\.mamba\.out_proj", r".*\.feed_forward\.down_proj")
    patch = None
    if groups < size and text.get("mamba_rms_norm"):
        before = text.get("mamba_norm_before_gate")
        patch = span_mamba2_norms(groups, inner, before_gate=True if before is None else before)
    return TPPlan(size, rank, ParamRules(rules), reduce, patch)
