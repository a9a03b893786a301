"""Recipes of the small random checkpoints: each family's config fields at a given size, and
the weight spreads applied after transformers' init (so that every switch of a family matters
and greedy continuations differ from token to token).

Shared by `bench/checkpoints.py` and the tests' checkpoints (tests/checkpoints.py), which pick
other sizes. A recipe returns plain keyword arguments for the transformers config class; the
caller seeds torch before building the model (the spreads draw from torch's generator in
parameter order, so a checkpoint depends only on the seed and its fields).
"""

from __future__ import annotations

from typing import Any

import torch

#: No special token ids: generation never stops early and no id is reserved.
NO_SPECIALS: dict[str, Any] = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


# -- config fields ---------------------------------------------------------------------------
#: The Mamba mixers' sizes every recipe uses (Mamba2 adds 8 heads; see _MAMBA2).
_MAMBA = dict(mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
_MAMBA2 = dict(mamba_n_heads=8, **_MAMBA)


def _base(vocab: int, hidden: int, layers: int, init: float, max_positions: int) -> dict:
    """What every recipe shares: 4 query heads over 2 KV heads, no special tokens."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=init,
        max_position_embeddings=max_positions,
        **NO_SPECIALS,
    )


def granite_fields(
    *,
    vocab: int,
    hidden: int,
    shared_intermediate: int,
    n_groups: int,
    chunk: int,
    init: float,
    max_positions: int,
) -> dict[str, Any]:
    """Granite-4.0-H-like (GraniteMoeHybridConfig): Mamba2, attention, Mamba2, Mamba2; MoE of
    4 experts (top 2) of width hidden / 2; muP multipliers away from 1."""
    return dict(
        _base(vocab, hidden, 4, init, max_positions),
        intermediate_size=hidden // 2,
        shared_intermediate_size=shared_intermediate,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        **_MAMBA2,
        mamba_n_groups=n_groups,
        mamba_chunk_size=chunk,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        attention_multiplier=0.12,
        residual_multiplier=0.6,
        logits_scaling=2.5,
    )


def gemma3_fields(
    *, vocab: int, hidden: int, window: int, query_scale: int, init: float, max_positions: int
) -> dict[str, Any]:
    """Gemma-3-like (Gemma3TextConfig): five layers, sliding, sliding, full, sliding, full;
    4 query heads of hidden / 4 over 2 KV heads; pad id 0, bos id 2, no eos."""
    sliding, full = "sliding_attention", "full_attention"
    return dict(
        _base(vocab, hidden, 5, init, max_positions),
        intermediate_size=3 * hidden // 2,
        head_dim=hidden // 4,
        sliding_window=window,
        layer_types=[sliding, sliding, full, sliding, full],
        query_pre_attn_scalar=query_scale,
        pad_token_id=0,
        bos_token_id=2,
    )


def jamba_fields(
    *, vocab: int, hidden: int, dt_rank: int, init: float, max_positions: int
) -> dict[str, Any]:
    """Jamba-like (JambaConfig): five layers, attention at 1 and 4 (period 3, offset 1),
    Mamba1 elsewhere; MoE (4 experts, top 2) at 1 and 3; projection biases."""
    return dict(
        _base(vocab, hidden, 5, init, max_positions),
        intermediate_size=3 * hidden // 4,
        attn_layer_period=3,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        **_MAMBA,
        mamba_dt_rank=dt_rank,
        mamba_proj_bias=True,
    )


def falcon_h1_fields(
    *, vocab: int, hidden: int, head_dim: int, chunk: int, init: float, max_positions: int
) -> dict[str, Any]:
    """Falcon-H1-like (FalconH1Config): three layers, each attention (4 query / 2 KV heads)
    beside Mamba2 (8 heads, inner size 3 hidden / 2; B/C in 2 groups), the grouped gated
    RMSNorm after the gate, biases on every projection. muP multipliers stay at 1."""
    return dict(
        _base(vocab, hidden, 3, init, max_positions),
        intermediate_size=3 * hidden // 2,
        head_dim=head_dim,
        attention_bias=True,
        mlp_bias=True,
        projectors_bias=True,
        mamba_proj_bias=True,
        mamba_d_ssm=3 * hidden // 2,
        **_MAMBA2,
        mamba_n_groups=2,
        mamba_chunk_size=chunk,
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def gpt_oss_fields(
    *, vocab: int, hidden: int, window: int, yarn_from: int, init: float, max_positions: int
) -> dict[str, Any]:
    """gpt-oss-like (GptOssConfig): four layers alternating sliding and full attention,
    4 experts (top 2), head_dim hidden / 4, 4 query heads over 2 KV heads, YaRN RoPE (factor
    4 from `yarn_from` positions, not truncated), a SwiGLU limit of 2.0 so the clamps bite."""
    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0)
    yarn.update(beta_slow=1.0, truncate=False, original_max_position_embeddings=yarn_from)
    return dict(
        _base(vocab, hidden, 4, init, max_positions),
        intermediate_size=3 * hidden // 4,
        head_dim=hidden // 4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=yarn,
        swiglu_limit=2.0,
    )


# -- weight spreads -------------------------------------------------------------------------
def spread_states(model, a_log: tuple[float, float], dt: tuple[float, float], dt_name: str):
    """Mamba / Mamba2 hybrids: decays spread over heads / channels (``A_log``, the parameter
    ending in `dt_name`), a random D, random biases and norm weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(*a_log)
            elif name.endswith(dt_name):
                p.uniform_(*dt)
            elif name.endswith(".D"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.3)


def spread_granite_mamba(model) -> None:
    """Granite-4.0-H: each Mamba2 layer's decays and time-step biases spread."""
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mamba is not None:
                layer.mamba.A_log.uniform_(-1.0, 1.0)
                layer.mamba.dt_bias.uniform_(-2.0, 0.5)


def spread_norms(model, mean: float, std: float) -> None:
    """Every parameter with "norm" in its name drawn from N(`mean`, `std`)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(mean, std)


def spread_biases_and_norms(model, bias_suffix: str = "bias", sinks: bool = False) -> None:
    """Random biases (names ending in `bias_suffix`, N(0, 0.3)) and norm weights (N(1, 0.3));
    with `sinks`, attention sinks first (N(0, 1)), as gpt-oss has them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if sinks and name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith(bias_suffix):
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
