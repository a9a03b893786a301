"""Nemotron-H."""

from __future__ import annotations

from hybrid_pd.engine.models.nemotron_h import layer_kinds
from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import LEADER_ONLY, ParamRules, Seg, Split


def _field(text: dict, key: str, legacy: str | None, default: int) -> int:
    """A size as Nemotron-H reads it (a legacy name, when present, wins)."""
    value = text.get(legacy) if legacy is not None and text.get(legacy) is not None else None
    if value is None:
        value = text.get(key)
    return default if value is None else int(value)


def _set(text: dict, key: str, legacy: str | None, value: int) -> None:
    text[key] = value
    if legacy is not None and text.get(legacy) is not None:
        text[legacy] = value


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Nemotron-H: blocks of one mixer each (Mamba2, attention, relu2 MLP or MoE with a
    shared expert), every block named ``mixer`` and every mixer ending row-parallel, so
    each block's output is the one all-reduce. The MoE splits each routed expert's and the
    shared expert's width; the router and the optional latent projections (hidden <->
    ``moe_latent_size``) are replicated, the latter's output bias kept by rank 0."""
    rank, text = base.rank_config(cfg)
    if text.get("head_dim") is None and text.get("attention_head_dim") is not None:
        text["head_dim"] = int(text["attention_head_dim"])
    rules, _ = base.split_attention(text, size, r".*\.mixer")
    m_heads = _field(text, "mamba_num_heads", None, 128)
    m_head_dim = _field(text, "mamba_head_dim", None, 64)
    groups = _field(text, "n_groups", "mamba_n_groups", 8)
    state = _field(text, "ssm_state_size", None, 128)
    _set(text, "mamba_num_heads", None, base.divide("mamba_num_heads", m_heads, size))
    _set(text, "n_groups", "mamba_n_groups", base.divide("n_groups", groups, size, replicate=True))
    inter = _field(text, "intermediate_size", None, 21504)
    text["intermediate_size"] = base.divide("intermediate_size", inter, size)
    rules += base.mamba2_rules(r".*\.mixer", m_heads, m_head_dim, groups, state)
    rules += (
        (r".*\.mixer\.up_proj\.(weight|bias)", Split(0, (Seg(inter),))),
        (r".*\.mixer\.down_proj\.weight", Split(1, (Seg(inter),))),
        (r".*\.mixer\.down_proj\.bias", LEADER_ONLY),
    )
    if "moe" in layer_kinds(text):
        moe = _field(text, "moe_intermediate_size", None, 7688)
        shared = _field(text, "moe_shared_expert_intermediate_size", None, 7688)
        text["moe_intermediate_size"] = base.divide("moe_intermediate_size", moe, size)
        text["moe_shared_expert_intermediate_size"] = base.divide(
            "moe_shared_expert_intermediate_size", shared, size
        )
        rules += (
            (r".*\.mixer\.experts\.up_proj", Split(1, (Seg(moe),))),  # [E, I, D]
            (r".*\.mixer\.experts\.down_proj", Split(2, (Seg(moe),))),  # [E, D, I]
            (r".*\.mixer\.shared_experts\.up_proj\.(weight|bias)", Split(0, (Seg(shared),))),
            (r".*\.mixer\.shared_experts\.down_proj\.weight", Split(1, (Seg(shared),))),
            (r".*\.mixer\.(shared_experts\.down_proj|fc2_latent_proj)\.bias", LEADER_ONLY),
        )
    patch = base.span_mamba2_norms(groups, m_heads * m_head_dim) if groups < size else None
    return base.TPPlan(size, rank, ParamRules(rules), (r".*layers\.\d+\.mixer",), patch)
