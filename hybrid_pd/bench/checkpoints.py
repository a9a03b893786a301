"""Small random checkpoints for the benchmarks, one per family, at a chosen hidden size.

Weights are random from a fixed seed, at a spread large enough that greedy continuations
differ from token to token (the benchmark checks how many distinct tokens a reference run
produced). Qwen3.5 comes from the product's own builder (`engine.tiny`); the others are
built with transformers and saved in Hugging Face format, with the byte-level tokenizer
of `engine.tiny`. Every size splits over 2 ranks (and 4 where heads allow).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

#: Families `build` knows, in the order `bench tp` runs them.
FAMILIES = ("qwen3_5", "granite", "gemma3", "jamba", "falcon_h1", "gpt_oss")
#: What each stands for.
DESCRIPTIONS = {
    "qwen3_5": "Qwen3.5-like: GDN + full attention",
    "granite": "Granite-4.0-H-like: Mamba2 (n_groups 1) + attention, MoE",
    "gemma3": "Gemma-3-like: sliding-window + full attention",
    "jamba": "Jamba-like: Mamba1 + attention, MoE",
    "falcon_h1": "Falcon-H1-like: attention beside Mamba2 in every layer",
    "gpt_oss": "gpt-oss-like: sliding + full attention, MoE with sinks",
}
VOCAB = 320
SW_WINDOW = 32
MAMBA_CHUNK = 32
_NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _std(hidden: int, at_64: float) -> float:
    """An initializer std that keeps activations as lively as `at_64` does at hidden 64."""
    return at_64 * math.sqrt(64 / hidden)


def qwen3_5(folder: Path, hidden: int) -> None:
    from hybrid_pd.engine.tiny import write_tiny_checkpoint

    head = max(32, hidden // 4)
    write_tiny_checkpoint(
        folder,
        {
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "head_dim": head,
            "linear_key_head_dim": head,
            "linear_value_head_dim": head,
        },
    )


def granite(folder: Path, hidden: int) -> None:
    import transformers

    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden // 2,
        shared_intermediate_size=hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_chunk_size=MAMBA_CHUNK,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        attention_multiplier=0.12,
        residual_multiplier=0.6,
        logits_scaling=2.5,
        initializer_range=_std(hidden, 0.2),
        max_position_embeddings=4096,
        **_NO_SPECIALS,
    )
    model = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mamba is not None:
                layer.mamba.A_log.uniform_(-1.0, 1.0)
                layer.mamba.dt_bias.uniform_(-2.0, 0.5)
    _save(model, folder)


def gemma3(folder: Path, hidden: int) -> None:
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 2,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        sliding_window=SW_WINDOW,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        query_pre_attn_scalar=hidden // 4,
        initializer_range=_std(hidden, 0.05),
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=2,
    )
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 2.0)
    _save(model, folder)


def _spread(model, a_log: tuple[float, float], dt: tuple[float, float], dt_name: str) -> None:
    """Decays spread over heads / channels, a random D, random biases and norm weights."""
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


def jamba(folder: Path, hidden: int) -> None:
    import transformers

    cfg = transformers.JambaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 4,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=3,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=16,
        mamba_proj_bias=True,
        initializer_range=_std(hidden, 0.2),
        max_position_embeddings=4096,
        **_NO_SPECIALS,
    )
    model = transformers.JambaForCausalLM(cfg).eval()
    _spread(model, (-1.0, 1.5), (-2.0, 0.5), "dt_proj.bias")
    _save(model, folder)


def falcon_h1(folder: Path, hidden: int) -> None:
    import transformers

    cfg = transformers.FalconH1Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        attention_bias=True,
        mlp_bias=True,
        projectors_bias=True,
        mamba_proj_bias=True,
        mamba_d_ssm=3 * hidden // 2,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_n_groups=2,
        mamba_chunk_size=MAMBA_CHUNK,
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=_std(hidden, 0.2),
        max_position_embeddings=4096,
        **_NO_SPECIALS,
    )
    model = transformers.FalconH1ForCausalLM(cfg).eval()
    _spread(model, (-1.0, 1.0), (-1.5, 0.5), "dt_bias")
    _save(model, folder)


def gpt_oss(folder: Path, hidden: int) -> None:
    import transformers

    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 4,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SW_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 1024,
        },
        swiglu_limit=2.0,
        initializer_range=_std(hidden, 0.2),
        max_position_embeddings=4096,
        **_NO_SPECIALS,
    )
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("_bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
    _save(model, folder)


_BUILDERS: dict[str, Callable[[Path, int], None]] = {
    "qwen3_5": qwen3_5,
    "granite": granite,
    "gemma3": gemma3,
    "jamba": jamba,
    "falcon_h1": falcon_h1,
    "gpt_oss": gpt_oss,
}


def _save(model, folder: Path) -> None:
    from transformers.utils import logging as hf_logging

    from hybrid_pd.engine.tiny import write_byte_tokenizer

    hf_logging.disable_progress_bar()
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder, model.config.vocab_size)


def build(family: str, root: Path, hidden: int, seed: int = 0) -> Path:
    """`family`'s checkpoint at hidden size `hidden` (a multiple of 64), written into a new
    folder under `root`; returns it. Raises ValueError for an unknown family."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    if hidden % 64:
        raise ValueError(f"hidden size {hidden} is not a multiple of 64")
    folder = root / f"{family}-h{hidden}"
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    _BUILDERS[family](folder, hidden)
    return folder
