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
                "bos_token_id": None,
                "eos_token_id": None,
                "pad_token_id": None,
            },
        )
    return folder
