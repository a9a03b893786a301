"""Per-family tensor-parallel plans: what a rank's model looks like, which weights split
how, and where partial sums meet.

A rank builds its model from a *rank config*: the checkpoint's config with every split
count (attention and KV heads, GDN key / value heads, Mamba2 heads and groups, MLP and
expert widths) replaced by its share, and every derived size (head dims, the Mamba2 inner
size) written out, so each family's own code builds a model of one rank's shape and its
cache specs give one rank's pool. Weights then split by parameter name (`ParamRules`);
the outputs of row-parallel modules (attention's o_proj, an MLP's down projection, a
mixer's out_proj, a whole MoE block) are all-reduced.

Not every family has a plan yet: `plan_for` names the ones that do and refuses the rest.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hybrid_pd.engine.tp.shard import LEADER_ONLY, ParamRules, Rule, Seg, Split


@dataclass(frozen=True)
class TPPlan:
    """What one rank of `size` needs to build and run its shard of a model."""

    size: int
    rank_config: dict
    params: ParamRules
    #: Module-name patterns (fullmatch) whose outputs are partial sums to all-reduce.
    reduce: tuple[str, ...]
    #: Changes the built rank model needs beyond sizes (model, group) -> None.
    patch: Callable[[nn.Module, Any], None] | None = field(default=None, compare=False)

    def reduces(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.reduce)


class TPConfigError(ValueError):
    """The model cannot be split over that many ranks (the message says why)."""


def _text(cfg: Mapping[str, Any]) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), Mapping) else cfg


def _int(text: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = text.get(key, default)
    if value is None:
        raise TPConfigError(f"config field {key!r} is needed to split the model")
    return int(value)


def _divide(what: str, count: int, size: int, replicate: bool = False) -> int:
    """Each rank's share of `count` units (1 for a replicated unit)."""
    if count % size == 0:
        return count // size
    if replicate and size % count == 0:
        return 1
    how = "a divisor or a multiple" if replicate else "a divisor"
    raise TPConfigError(f"tensor-parallel size {size} must be {how} of {what} ({count})")


# ------------------------------------------------------------------------- shared rules


def attention_rules(prefix: str, heads: int, kv_heads: int, head_dim: int, q_width: int = 0):
    """q / k / v / o of attention modules named `prefix` (a pattern). `q_width`: rows per
    query head when they are not head_dim (Qwen3.5's gate rides with its query)."""
    return (
        (rf"{prefix}\.q_proj\.(weight|bias)", Split(0, (Seg(heads, q_width or head_dim),))),
        (rf"{prefix}\.[kv]_proj\.(weight|bias)", Split(0, (Seg(kv_heads, head_dim, True),))),
        (rf"{prefix}\.o_proj\.weight", Split(1, (Seg(heads, head_dim),))),
        (rf"{prefix}\.o_proj\.bias", LEADER_ONLY),
    )


def gated_mlp_rules(prefix: str, inter: int) -> tuple[tuple[str, Rule], ...]:
    """gate / up (column-parallel) and down (row-parallel) of a GatedMLP named `prefix`."""
    return (
        (rf"{prefix}\.(gate|up)_proj\.(weight|bias)", Split(0, (Seg(inter),))),
        (rf"{prefix}\.down_proj\.weight", Split(1, (Seg(inter),))),
        (rf"{prefix}\.down_proj\.bias", LEADER_ONLY),
    )


def _attention_sizes(text: dict, size: int) -> tuple[int, int, int]:
    heads = _int(text, "num_attention_heads")
    kv = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or _int(text, "hidden_size") // heads)
    text["num_attention_heads"] = _divide("num_attention_heads", heads, size)
    text["num_key_value_heads"] = _divide("num_key_value_heads", kv, size, replicate=True)
    text["head_dim"] = head_dim
    return heads, kv, head_dim


# ------------------------------------------------------------------------- families


def _dense(cfg: dict, size: int) -> TPPlan:
    """Llama, Mistral, Qwen2, Qwen3 and Gemma 3: attention + gated MLP per layer."""
    rank = copy.deepcopy(cfg)
    text = _text(rank)
    heads, kv, head_dim = _attention_sizes(text, size)
    inter = _int(text, "intermediate_size")
    text["intermediate_size"] = _divide("intermediate_size", inter, size)
    rules = attention_rules(r".*\.self_attn", heads, kv, head_dim) + gated_mlp_rules(
        r".*\.mlp", inter
    )
    return TPPlan(size, rank, ParamRules(rules), (r".*\.self_attn\.o_proj", r".*\.mlp\.down_proj"))


def mamba2_rules(prefix: str, heads: int, head_dim: int, groups: int, state: int):
    """A Mamba2Mixer named `prefix`: in_proj rows [z | x | B | C | dt], conv channels
    [x | B | C], per-head vectors, the gated norm's weight, out_proj columns."""
    hp, gn = Seg(heads, head_dim), Seg(groups, state, True)
    return (
        (rf"{prefix}\.in_proj\.(weight|bias)", Split(0, (hp, hp, gn, gn, Seg(heads)))),
        (rf"{prefix}\.conv1d\.(weight|bias)", Split(0, (hp, gn, gn))),
        (rf"{prefix}\.(dt_bias|A_log|D)", Split(0, (Seg(heads),))),
        (rf"{prefix}\.norm\.weight", Split(0, (hp,))),
        (rf"{prefix}\.out_proj\.weight", Split(1, (hp,))),
        (rf"{prefix}\.out_proj\.bias", LEADER_ONLY),
    )


def _granite(cfg: dict, size: int) -> TPPlan:
    """Granite-4.0-H: attention or Mamba2 per layer, a shared MLP and optional MoE."""
    rank = copy.deepcopy(cfg)
    text = _text(rank)
    heads, kv, head_dim = _attention_sizes(text, size)
    hidden = _int(text, "hidden_size")
    m_heads = _int(text, "mamba_n_heads", 128)
    groups = _int(text, "mamba_n_groups", 1)
    state = _int(text, "mamba_d_state", 256)
    expand = float(text.get("mamba_expand") or 2)
    inner = int(expand * hidden)
    d_head = text.get("mamba_d_head", "auto")
    m_head_dim = inner // m_heads if d_head in (None, "auto") else int(d_head)
    text["mamba_n_heads"] = _divide("mamba_n_heads", m_heads, size)
    text["mamba_n_groups"] = _divide("mamba_n_groups", groups, size, replicate=True)
    text["mamba_d_head"] = m_head_dim
    text["mamba_expand"] = expand / size
    if int(text["mamba_expand"] * hidden) != inner // size:
        raise TPConfigError(f"the Mamba2 inner size {inner} does not split over {size} ranks")
    rules = attention_rules(r".*\.self_attn", heads, kv, head_dim)
    rules += mamba2_rules(r".*\.mamba", m_heads, m_head_dim, groups, state)
    reduce = [r".*\.self_attn\.o_proj", r".*\.mamba\.out_proj", r".*\.shared_mlp"]
    shared = _int(text, "shared_intermediate_size", 1024)
    text["shared_intermediate_size"] = _divide("shared_intermediate_size", shared, size)
    rules += (
        (r".*\.shared_mlp\.input_linear\.weight", Split(0, (Seg(shared), Seg(shared)))),
        (r".*\.shared_mlp\.output_linear\.weight", Split(1, (Seg(shared),))),
    )
    if int(text.get("num_local_experts") or 0) > 0:
        inter = _int(text, "intermediate_size")
        text["intermediate_size"] = _divide("intermediate_size", inter, size)
        rules += (
            (r".*\.block_sparse_moe\.input_linear\.weight", Split(1, (Seg(inter), Seg(inter)))),
            (r".*\.block_sparse_moe\.output_linear\.weight", Split(2, (Seg(inter),))),
        )
        reduce.append(r".*\.block_sparse_moe")
    patch = _span_mamba2_norms(groups, inner) if groups < size else None
    return TPPlan(size, rank, ParamRules(rules), tuple(reduce), patch)


def _span_mamba2_norms(groups: int, inner: int):
    """With fewer Mamba2 groups than ranks a norm group spans several ranks."""

    def patch(model: nn.Module, group) -> None:
        from hybrid_pd.engine.tp.norms import SpannedGatedRMSNorm

        for module in list(model.modules()):
            norm = getattr(module, "norm", None)
            if type(module).__name__ == "Mamba2Mixer" and norm is not None:
                module.norm = SpannedGatedRMSNorm(norm, group, groups, inner // groups)

    return patch


def _qwen3_5(cfg: dict, size: int) -> TPPlan:
    """Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet or gated attention per layer,
    a gated MLP or a MoE of stacked experts with a shared expert."""
    rank = copy.deepcopy(cfg)
    text = _text(rank)
    heads, kv, head_dim = _attention_sizes(text, size)
    k_heads = _int(text, "linear_num_key_heads")
    v_heads = _int(text, "linear_num_value_heads")
    dk, dv = _int(text, "linear_key_head_dim"), _int(text, "linear_value_head_dim")
    text["linear_num_key_heads"] = _divide("linear_num_key_heads", k_heads, size)
    text["linear_num_value_heads"] = _divide("linear_num_value_heads", v_heads, size)
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
        inter = _int(text, "intermediate_size")
        text["intermediate_size"] = _divide("intermediate_size", inter, size)
        rules += gated_mlp_rules(r".*\.mlp", inter)
    if int(text.get("num_experts") or 0) > 0:
        moe = _int(text, "moe_intermediate_size")
        shared = _int(text, "shared_expert_intermediate_size")
        text["moe_intermediate_size"] = _divide("moe_intermediate_size", moe, size)
        text["shared_expert_intermediate_size"] = _divide(
            "shared_expert_intermediate_size", shared, size
        )
        rules += (
            (r".*\.mlp\.(gate|up)_proj", Split(1, (Seg(moe),))),
            (r".*\.mlp\.down_proj", Split(2, (Seg(moe),))),
            *gated_mlp_rules(r".*\.mlp\.shared_expert", shared),
        )
    return TPPlan(size, rank, ParamRules(rules), reduce)


_PLANS: dict[str, Callable[[dict, int], TPPlan]] = {
    "LlamaForCausalLM": _dense,
    "MistralForCausalLM": _dense,
    "Qwen2ForCausalLM": _dense,
    "Qwen3ForCausalLM": _dense,
    "Gemma3ForCausalLM": _dense,
    "Gemma3ForConditionalGeneration": _dense,
    "GraniteMoeHybridForCausalLM": _granite,
    "Qwen3_5ForCausalLM": _qwen3_5,
    "Qwen3_5ForConditionalGeneration": _qwen3_5,
    "Qwen3_5MoeForCausalLM": _qwen3_5,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5,
    "Qwen3NextForCausalLM": _qwen3_5,
}


def plan_for(config: dict, size: int) -> TPPlan:
    """The plan for `config` over `size` ranks; TPConfigError when the architecture has
    none yet or its sizes do not split."""
    arch = (config.get("architectures") or ["?"])[0]
    build = _PLANS.get(arch)
    if build is None:
        raise TPConfigError(
            f"tensor parallelism is not available for {arch} yet; it is for: "
            + ", ".join(sorted(set(_PLANS)))
        )
    return build(config, size)
