"""Tiny random checkpoints vLLM's CPU build can run (head_dim 64), in Hugging Face format.

Weights are drawn with a std large enough that greedy continuations differ from prompt to
prompt (test_servers checks it)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid_pd.engine.tiny import write_byte_tokenizer, write_tiny_checkpoint

VOCAB = 300


def gemma3(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        sliding_window=32,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        query_pre_attn_scalar=64,
        initializer_range=0.05,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=2,
    )
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 2.0)
    return _save(model, folder)


def granite_hybrid(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=64,
        shared_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_d_head=64,
        mamba_chunk_size=16,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        attention_multiplier=0.12,
        residual_multiplier=0.6,
        logits_scaling=2.5,
        initializer_range=0.2,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.mamba is not None:
                layer.mamba.A_log.uniform_(-1.0, 1.0)
                layer.mamba.dt_bias.uniform_(-2.0, 0.5)
    return _save(model, folder)


def qwen3_5(folder: Path) -> Path:
    """Gated DeltaNet + full attention (the built-in checkpoint's family at head_dim 64)."""
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_tiny_checkpoint(
            folder,
            {
                "vocab_size": VOCAB,
                "head_dim": 64,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_num_key_heads": 1,
                "linear_num_value_heads": 2,
                "bos_token_id": None,
                "eos_token_id": None,
                "pad_token_id": None,
            },
        )
    return folder


def _save(model, folder: Path) -> Path:
    if not (folder / "config.json").exists():
        model.save_pretrained(folder, safe_serialization=True)
        write_byte_tokenizer(folder, VOCAB)
    return folder
