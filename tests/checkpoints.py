"""Tiny random checkpoints of the engine architectures, saved in Hugging Face format (the
families the benchmarks share come from `hybrid_pd/bench/recipes.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid_pd.bench import recipes
from hybrid_pd.engine.tiny import ensure_tiny, write_byte_tokenizer

#: The recipe sizes of the tests' checkpoints (bench/recipes.py).
_TINY = dict(vocab=300, hidden=64, max_positions=2048)
SW_WINDOW = 16
MAMBA_CHUNK = 16


def qwen3_5(root: Path) -> Path:
    return ensure_tiny(root)


def granite_hybrid(
    root: Path, name: str = "granite", tokenizer_vocab: int | None = None, **overrides
) -> Path:
    """`overrides`: config fields to change (other sizes); `tokenizer_vocab`: pad the
    tokenizer to this many ids."""
    import transformers

    torch.manual_seed(0)
    fields = recipes.granite_fields(
        **_TINY, shared_intermediate=48, n_groups=2, chunk=MAMBA_CHUNK, init=0.2
    )
    cfg = transformers.GraniteMoeHybridConfig(**{**fields, **overrides})
    model = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    recipes.spread_granite_mamba(model)
    return _save(model, root / name, tokenizer_vocab)


def gemma3(
    root: Path, name: str = "gemma3", tokenizer_vocab: int | None = None, **overrides
) -> Path:
    """As granite_hybrid."""
    import transformers

    folder = root / name
    torch.manual_seed(0)
    fields = recipes.gemma3_fields(**_TINY, window=SW_WINDOW, query_scale=24, init=0.05)
    cfg = transformers.Gemma3TextConfig(**{**fields, **overrides})
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    recipes.spread_norms(model, 0.0, 2.0)
    return _save(model, folder, tokenizer_vocab)


# The dense Llama-family decoders. Weights: transformers' init at a larger std, plus random
# biases and norm weights (transformers starts them at 0 and 1), so that every switch of the
# family matters and greedy continuations differ from prompt to prompt.
_DENSE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.15,
    **recipes.NO_SPECIALS,
)


def _dense(config_cls: str, model_cls: str, folder: Path, fields: dict, tokenizer_vocab):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**fields)
    model = getattr(transformers, model_cls)(cfg).eval()
    recipes.spread_biases_and_norms(model)
    return _save(model, folder, tokenizer_vocab)


def llama(root: Path, name: str = "llama", tokenizer_vocab: int | None = None, **overrides):
    """Llama 3.1-style RoPE (llama3 scaling from 64 positions), q/k/v/o and MLP biases,
    head_dim derived (64 / 4 heads)."""
    fields = dict(
        _DENSE,
        num_hidden_layers=3,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    fields.update(overrides)
    return _dense("LlamaConfig", "LlamaForCausalLM", root / name, fields, tokenizer_vocab)


def mistral(root: Path, name: str = "mistral", tokenizer_vocab: int | None = None, **overrides):
    """Sliding window (SW_WINDOW) on every layer, one KV head, head_dim 32 given."""
    fields = dict(
        _DENSE,
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=SW_WINDOW,
    )
    fields.update(overrides)
    return _dense("MistralConfig", "MistralForCausalLM", root / name, fields, tokenizer_vocab)


def qwen2(root: Path, name: str = "qwen2", tokenizer_vocab: int | None = None, **overrides):
    """q/k/v biases, tied embeddings, yarn RoPE (factor 4 from 512 positions)."""
    fields = dict(
        _DENSE,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    )
    fields.update(overrides)
    return _dense("Qwen2Config", "Qwen2ForCausalLM", root / name, fields, tokenizer_vocab)


def qwen3(root: Path, name: str = "qwen3", tokenizer_vocab: int | None = None, **overrides):
    """Per-head q/k norms, head_dim 32 given (not 64 / 4 heads), RoPE theta 1e6."""
    fields = dict(
        _DENSE,
        num_hidden_layers=3,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    fields.update(overrides)
    return _dense("Qwen3Config", "Qwen3ForCausalLM", root / name, fields, tokenizer_vocab)


# The Mamba2 hybrids without MoE. Weights: transformers' init at std 0.2, then A and dt spread
# so that heads decay at different rates, a random D, random biases and norm weights
# (transformers starts them at 0 and 1), so greedy continuations differ from prompt to prompt.
_MAMBA2 = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    max_position_embeddings=2048,
    **recipes.NO_SPECIALS,
)


def _spread_mamba2(model) -> None:
    recipes.spread_states(model, (-1.0, 1.0), (-1.5, 0.5), "dt_bias")
    with torch.no_grad():
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # Nemotron-H MoE routers
                b.normal_(0.0, 0.1)


def bamba(root: Path, name: str = "bamba", tokenizer_vocab: int | None = None, **overrides):
    """Attention at layer 1 of 4, B/C in 2 groups, RoPE on half of each 16-dim head (as
    BambaConfig forces), MLP and attention biases."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        _MAMBA2,
        num_hidden_layers=4,
        attn_layer_indices=[1],
        attention_bias=True,
        mlp_bias=True,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_n_groups=2,
        mamba_chunk_size=MAMBA_CHUNK,
    )
    fields.update(overrides)
    model = transformers.BambaForCausalLM(transformers.BambaConfig(**fields)).eval()
    _spread_mamba2(model)
    return _save(model, root / name, tokenizer_vocab)


def nemotron_h(
    root: Path, name: str = "nemotron_h", tokenizer_vocab: int | None = None, **overrides
):
    """Pattern M-*M- (Mamba2, relu2 MLP, attention, Mamba2, MLP), B/C in 2 groups, Mamba
    inner size 8 heads x 24 (not expand x hidden), projection and MLP biases. No time-step
    limit (time_step_min 1e-4, which transformers before 5.25 also took as the floor, below
    every dt): transformers' decode path would skip a clamp that bites."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        _MAMBA2,
        hybrid_override_pattern="M-*M-",
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=24,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=MAMBA_CHUNK,
        use_bias=True,
        mlp_bias=True,
        time_step_min=1e-4,
    )
    fields.update(overrides)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**fields)).eval()
    _spread_mamba2(model)
    return _save(model, root / name, tokenizer_vocab)


def falcon_h1(root: Path, name: str = "falcon_h1", tokenizer_vocab: int | None = None, **overrides):
    """Three layers, each attention (4 query / 2 KV heads of 32, not 64 / 4) beside Mamba2
    (8 heads, inner size mamba_d_ssm 96, not mamba_expand x hidden; B/C in 2 groups), every
    muP multiplier away from 1, the grouped gated RMSNorm after the gate, and biases on
    every projection."""
    import transformers

    torch.manual_seed(0)
    fields = recipes.falcon_h1_fields(**_TINY, head_dim=32, chunk=MAMBA_CHUNK, init=0.2)
    fields.update(
        embedding_multiplier=1.5,
        lm_head_multiplier=0.7,
        key_multiplier=0.6,
        attention_in_multiplier=1.3,
        attention_out_multiplier=0.8,
        ssm_in_multiplier=0.9,
        ssm_out_multiplier=1.2,
        mlp_multipliers=[0.8, 1.1],
        ssm_multipliers=[0.7, 1.2, 0.9, 1.4, 0.6],
    )
    fields.update(overrides)
    model = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**fields)).eval()
    _spread_mamba2(model)
    return _save(model, root / name, tokenizer_vocab)


def jamba(root: Path, name: str = "jamba", tokenizer_vocab: int | None = None, **overrides):
    """Five layers: attention at 1 and 4 (period 3, offset 1), Mamba1 at 0, 2, 3; MoE (4
    experts, top 2) at 1 and 3; dt rank 8, projection biases. Weights: transformers' init at
    std 0.2, then A and the dt bias spread so that channels decay at different rates, a random
    D, random biases and norm weights (dt / B / C layernorms included)."""
    import transformers

    torch.manual_seed(0)
    fields = recipes.jamba_fields(**_TINY, dt_rank=8, init=0.2)
    fields.update(overrides)
    model = transformers.JambaForCausalLM(transformers.JambaConfig(**fields)).eval()
    recipes.spread_states(model, (-1.0, 1.5), (-2.0, 0.5), "dt_proj.bias")
    return _save(model, root / name, tokenizer_vocab)


def gpt_oss(root: Path, name: str = "gpt_oss", tokenizer_vocab: int | None = None, **overrides):
    """Four layers alternating sliding (SW_WINDOW) and full attention, 4 experts (top 2),
    head_dim 16, 4 query heads over 2 KV heads, YaRN RoPE (factor 4 from 512 positions, not
    truncated) and a tighter SwiGLU limit (2.0) so that the clamps bite. Weights:
    transformers' init at std 0.2 (attention sinks and router bias included), plus random
    expert biases (transformers starts them at 0) and norm weights."""
    import transformers

    torch.manual_seed(0)
    fields = recipes.gpt_oss_fields(**_TINY, window=SW_WINDOW, yarn_from=512, init=0.2)
    fields.update(overrides)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**fields)).eval()
    recipes.spread_biases_and_norms(model, bias_suffix="_bias", sinks=True)
    return _save(model, root / name, tokenizer_vocab)


def qwen3_next(
    root: Path, name: str = "qwen3_next", tokenizer_vocab: int | None = None, **overrides
) -> Path:
    """Four layers, full attention every second (GDN, attention, GDN, attention); GDN with 2
    key heads of 32 and 4 value heads of 16 (two value heads per key head, so the fused
    projections' per-key-head grouping matters); attention head_dim 32 with RoPE on a quarter;
    MoE (4 experts, top 2, plus the gated shared expert) on layers 0, 1 and 3, a dense MLP on
    layer 2 (`mlp_only_layers`). Weights: transformers' init at std 0.2, then the decays
    spread and random norm weights (the (1 + w) norms around 0, the gated one around 1)."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        norm_topk_prob=True,
        initializer_range=0.2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **recipes.NO_SPECIALS,
    )
    fields.update(overrides)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**fields)).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("A_log"):
                p.uniform_(-2.0, 1.0)
            elif param_name.endswith("dt_bias"):
                p.uniform_(-1.5, 1.0)
            elif param_name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.3)
            elif param_name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return _save(model, root / name, tokenizer_vocab)


def llama4(root: Path, name: str = "llama4", tokenizer_vocab: int | None = None, **overrides):
    """Llama 4 text: four layers, NoPE (global) on every second (`no_rope_layer_interval` 2),
    chunked local attention in chunks of SW_WINDOW on the RoPE layers (Llama 3.1-style RoPE on
    adjacent pairs, L2 q/k norm); MoE (4 experts, top 2, sigmoid router, shared expert) on
    layers 1 and 2, dense MLPs of another width on 0 and 3; head_dim 16, 4 query heads over 2
    KV heads; attention temperature tuning with floor_scale 4 so that it grows within a test
    prompt. Weights: transformers' init at std 0.2, plus random norm weights."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_layers=[1, 2],
        no_rope_layer_interval=2,
        attention_chunk_size=SW_WINDOW,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        **recipes.NO_SPECIALS,
    )
    fields.update(overrides)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**fields)).eval()
    recipes.spread_norms(model, 1.0, 0.3)
    return _save(model, root / name, tokenizer_vocab)


def _save(model, folder: Path, tokenizer_vocab: int | None = None) -> Path:
    if not (folder / "config.json").exists():
        model.save_pretrained(folder, safe_serialization=True)
        write_byte_tokenizer(folder, tokenizer_vocab)
    return folder


# The checkpoints the P/D and remote-KV tests run (each costs two worker processes, about
# 5 s, in the P/D test).
BUILDERS = {
    "qwen3_5": qwen3_5,
    "granite_hybrid": granite_hybrid,
    "bamba": bamba,
    "nemotron_h": nemotron_h,
    "jamba": jamba,
    "falcon_h1": falcon_h1,
    "gemma3": gemma3,
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gpt_oss": gpt_oss,
    "qwen3_next": qwen3_next,
    "llama4": llama4,
}
