"""Full-size random-weight checkpoints made from the published `config.json` values of real
models (sizes, layer pattern, heads, state sizes, vocabulary), never downloaded: what the
engine benchmark measures at the shapes users serve. Weights are random (transformers' init,
then the family's spreads of `recipes`); the tokenizer is the byte-level one with the
vocabulary padded to the model's size.

    granite-4.0-h-350m-like   Mamba2 hybrid: 32 layers (28 Mamba2, 4 attention), hidden 768,
                              48 Mamba2 heads of 32 at d_state 128, vocabulary 100,352
    gemma-3-270m-like         sliding window 512 (5 of 6 layers) + full, head_dim 256, one
                              KV head, vocabulary 262,144
    qwen3.5-0.8b-like         Gated DeltaNet hybrid: 24 layers (3 GDN : 1 attention), head
                              dims 128 (GDN) and 256 (attention), vocabulary 248,320

A checkpoint is written once into the cache folder (`HYBRID_PD_CACHE`'s, as the built-in
model) and reused.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hybrid_pd.bench import recipes

#: Bump when a recipe changes: the cached checkpoints are then rebuilt.
_VERSION = "v1"
#: Shapes rewritten since v1: Gemma's (its norms' weights all zero, its greedy tokens one
#: token repeated: the scaled embedding outweighed every layer; now spread as the toy's).
_VERSIONS = {"gemma-3-270m-like": "v2"}


def _granite_350m() -> dict[str, Any]:
    mamba, attention = "mamba", "attention"
    layers = [mamba] * 32
    for i in (10, 13, 17, 27):  # the published pattern's attention layers
        layers[i] = attention
    return dict(
        vocab_size=100352,
        hidden_size=768,
        num_hidden_layers=32,
        layer_types=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        shared_intermediate_size=2048,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=48,
        mamba_d_head=32,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        position_embedding_type="nope",
        embedding_multiplier=12.0,
        attention_multiplier=0.015625,
        residual_multiplier=0.246,
        logits_scaling=3.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        initializer_range=0.1,
        **recipes.NO_SPECIALS,
    )


def _gemma3_270m() -> dict[str, Any]:
    sliding, full = "sliding_attention", "full_attention"
    return dict(
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        layer_types=([sliding] * 5 + [full]) * 3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        query_pre_attn_scalar=256,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        initializer_range=0.02,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=None,
    )


def _qwen3_5_08b() -> dict[str, Any]:
    return {
        "vocab_size": 248320,
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    }


def _qwen_layers(fields: dict[str, Any]) -> dict[str, Any]:
    gdn, full = "linear_attention", "full_attention"
    return {**fields, "layer_types": [gdn, gdn, gdn, full] * 6}


#: name -> (transformers config class, model class, fields, spread of the weights); None
#: classes: the built-in Qwen3.5 writer.
REAL_SHAPES: dict[str, tuple[str | None, str | None, Any, Any]] = {
    "granite-4.0-h-350m-like": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        _granite_350m,
        recipes.spread_granite_mamba,
    ),
    "gemma-3-270m-like": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        _gemma3_270m,
        partial(recipes.spread_norms, mean=0.0, std=2.0),
    ),
    "qwen3.5-0.8b-like": (None, None, lambda: _qwen_layers(_qwen3_5_08b()), None),
}


def _write(name: str, folder: Path) -> None:
    from hybrid_pd.bench.checkpoints import _hf
    from hybrid_pd.engine.tiny import write_tiny_checkpoint

    config_cls, model_cls, fields, spread = REAL_SHAPES[name]
    torch.manual_seed(0)
    if config_cls is None:
        write_tiny_checkpoint(folder, fields())
    else:
        _hf(folder, config_cls, model_cls, fields(), spread or (lambda model: None))
    config = json.loads((folder / "config.json").read_text())
    config["hybrid_pd_real_shape"] = name  # what the folder holds, for a reader
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def ensure_real_shape(name: str, root: Path | None = None) -> Path:
    """The checkpoint folder of real shape `name` (REAL_SHAPES), written on first use under
    `root` (default: the engine's cache folder). ValueError for an unknown name."""
    from hybrid_pd.engine.tiny import cache_root, ensure_folder

    if name not in REAL_SHAPES:
        raise ValueError(f"unknown real shape {name!r}; known: {', '.join(REAL_SHAPES)}")
    folder = (root or cache_root()) / "real-shapes" / f"{name}-{_VERSIONS.get(name, _VERSION)}"
    return ensure_folder(folder, "config.json", lambda tmp: _write(name, tmp))


def resolve_bench_model(name_or_path: str) -> Path:
    """A real shape's name (REAL_SHAPES), `tiny`, or a checkpoint folder."""
    from hybrid_pd.engine.tiny import resolve_model

    return (
        ensure_real_shape(name_or_path)
        if name_or_path in REAL_SHAPES
        else resolve_model(name_or_path)
    )
