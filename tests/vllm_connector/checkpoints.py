"""Tiny random checkpoints vLLM's CPU build can run (head_dim 64), in Hugging Face format:
the engine tests' checkpoints at other sizes, tokenizers padded to the whole vocabulary.

Weights are drawn with a std large enough that greedy continuations differ from prompt to
prompt (test_servers checks it)."""

from __future__ import annotations

from pathlib import Path

from hybrid_pd.engine.tiny import write_tiny_checkpoint
from tests import checkpoints as base

VOCAB = 300


def gemma3(folder: Path, **overrides) -> Path:
    """`overrides`: config fields to change (e.g. the bench's larger sizes)."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=64,
    )
    fields.update(overrides)
    return base.gemma3(
        folder.parent, name=folder.name, tokenizer_vocab=fields["vocab_size"], **fields
    )


def granite_hybrid(folder: Path, **overrides) -> Path:
    """As gemma3."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=64,
        shared_intermediate_size=96,
        num_attention_heads=2,
        num_key_value_heads=1,
        mamba_n_heads=4,
        mamba_n_groups=1,
        mamba_d_head=64,
    )
    fields.update(overrides)
    return base.granite_hybrid(
        folder.parent, name=folder.name, tokenizer_vocab=fields["vocab_size"], **fields
    )


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
                # as Qwen3.5's published checkpoints: vLLM keeps the recurrent state in float32
                "mamba_ssm_dtype": "float32",
                "bos_token_id": None,
                "eos_token_id": None,
                "pad_token_id": None,
            },
        )
    return folder


def granite_hybrid_62m(folder: Path) -> Path:
    """Granite-4.0-H-like at the size `bench engine --peer vllm` is run on (docs/vllm.md):
    hidden 512, 8 Mamba2 + 2 attention layers, 4 experts (top 2), vocab 32000, tied."""
    return granite_hybrid(
        folder,
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=10,
        layer_types=["mamba"] * 4 + ["attention"] + ["mamba"] * 4 + ["attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=256,
        shared_intermediate_size=1024,
        mamba_n_heads=16,
        mamba_d_state=64,
        mamba_chunk_size=256,
        initializer_range=0.05,
        tie_word_embeddings=True,
    )


def gemma3_62m(folder: Path) -> Path:
    """Gemma-3-like at the bench's size: hidden 512, 10 sliding-window (128) + 2 full
    attention layers, vocab 32000."""
    return gemma3(
        folder,
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        sliding_window=128,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
    )


def qwen3_5_62m(folder: Path) -> Path:
    """Qwen3.5-like at the bench's size: hidden 512, 6 Gated DeltaNet + 2 full attention
    layers, head_dim 64, vocab 32000, recurrent state in float32 (run it in bfloat16)."""
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_tiny_checkpoint(
            folder,
            {
                "vocab_size": 32000,
                "hidden_size": 512,
                "intermediate_size": 1536,
                "num_hidden_layers": 8,
                "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
                "head_dim": 64,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_num_key_heads": 4,
                "linear_num_value_heads": 8,
                "mamba_ssm_dtype": "float32",
                "bos_token_id": None,
                "eos_token_id": None,
                "pad_token_id": None,
            },
        )
    return folder
