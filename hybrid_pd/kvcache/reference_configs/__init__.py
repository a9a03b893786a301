"""Published Hugging Face ``config.json`` contents (trimmed), keyed by checkpoint name; the
tables live in one module per family group (`qwen_gdn`, `gemma3`, `mamba_hybrids`,
`attention`).

Used by `hybrid-pd plan NAME`, the planner table of `hybrid-pd bench kvcache` and the tests.
Sizes are the real published ones;
fields that do not affect the cache (tokenizer ids, vision towers, MoE routing constants) are
mostly dropped, and multimodal configs keep their ``text_config`` nesting, including the
fields that the real ``text_config`` leaves to transformers defaults (Gemma 3 4B/27B).

Fields not checked against the published file (everything else was seen verbatim in public
copies of these configs): the order of Granite-4.0-H-Small's four attention layers (36 mamba /
4 attention is confirmed; positions 5/15/25/35 are assumed), Bamba-9B's
``max_position_embeddings``, and the ``dtype`` key of Qwen3.5-27B's ``text_config``.
Falcon-H1-7B-Instruct was written from memory and transformers' size table (44 layers, hidden
3072, 12 query / 2 KV heads of 128, 24 Mamba heads of 128, state 256, 256K context); not
checked against the published file: ``mamba_n_groups``, ``mamba_chunk_size``,
``intermediate_size``, ``vocab_size``, ``mamba_rms_norm`` / ``mamba_norm_before_gate`` and
the muP multipliers.
"""

from __future__ import annotations

from typing import Any

from hybrid_pd.kvcache.reference_configs.attention import ATTENTION
from hybrid_pd.kvcache.reference_configs.gemma3 import GEMMA3
from hybrid_pd.kvcache.reference_configs.mamba_hybrids import MAMBA_HYBRIDS
from hybrid_pd.kvcache.reference_configs.qwen_gdn import QWEN_GDN

#: Every checkpoint, in the order the tables list them (the planner tables show this order).
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {**QWEN_GDN, **GEMMA3, **MAMBA_HYBRIDS, **ATTENTION}


def short_name(name: str) -> str:
    """'Qwen/Qwen3-Next-80B-A3B-Instruct' -> 'qwen3-next-80b-a3b-instruct'."""
    return name.rsplit("/", 1)[-1].lower()


def reference_config(name: str) -> dict[str, Any] | None:
    """The config for a full or short (case-insensitive) checkpoint name, or None."""
    if name in REFERENCE_CONFIGS:
        return REFERENCE_CONFIGS[name]
    for full, cfg in REFERENCE_CONFIGS.items():
        if short_name(full) == name.lower():
            return cfg
    return None
