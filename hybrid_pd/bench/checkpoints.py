"""Small random checkpoints for the benchmarks, one per family, at a chosen hidden size.

Weights are random from a fixed seed, at a spread large enough that greedy continuations
differ from token to token (the benchmark checks how many distinct tokens a reference run
produced). Qwen3.5 comes from the product's own builder (`engine.tiny`); the others are
built with transformers from the shared recipes (`bench/recipes.py`) and saved in Hugging
Face format, with the byte-level tokenizer of `engine.tiny`. Every size splits over 2 ranks
(and 4 where heads allow).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hybrid_pd.bench import recipes

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


def _sizes(hidden: int, std_at_64: float) -> dict:
    """The recipe arguments every family takes from the size."""
    return dict(vocab=VOCAB, hidden=hidden, init=_std(hidden, std_at_64), max_positions=4096)


def _hf(folder: Path, config_cls: str, model_cls: str, fields: dict, spread) -> None:
    """A transformers model of `fields`, its weights spread by `spread`, saved in `folder`."""
    import transformers

    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).eval()
    spread(model)
    _save(model, folder)


def granite(folder: Path, hidden: int) -> None:
    fields = recipes.granite_fields(
        **_sizes(hidden, 0.2), shared_intermediate=hidden, n_groups=1, chunk=MAMBA_CHUNK
    )
    _hf(
        folder,
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        fields,
        recipes.spread_granite_mamba,
    )


def gemma3(folder: Path, hidden: int) -> None:
    fields = recipes.gemma3_fields(
        **_sizes(hidden, 0.05), window=SW_WINDOW, query_scale=hidden // 4
    )
    _hf(
        folder,
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        fields,
        partial(recipes.spread_norms, mean=0.0, std=2.0),
    )


def jamba(folder: Path, hidden: int) -> None:
    fields = recipes.jamba_fields(**_sizes(hidden, 0.2), dt_rank=16)
    spread = partial(
        recipes.spread_states, a_log=(-1.0, 1.5), dt=(-2.0, 0.5), dt_name="dt_proj.bias"
    )
    _hf(folder, "JambaConfig", "JambaForCausalLM", fields, spread)


def falcon_h1(folder: Path, hidden: int) -> None:
    fields = recipes.falcon_h1_fields(
        **_sizes(hidden, 0.2), head_dim=hidden // 4, chunk=MAMBA_CHUNK
    )
    spread = partial(recipes.spread_states, a_log=(-1.0, 1.0), dt=(-1.5, 0.5), dt_name="dt_bias")
    _hf(folder, "FalconH1Config", "FalconH1ForCausalLM", fields, spread)


def gpt_oss(folder: Path, hidden: int) -> None:
    fields = recipes.gpt_oss_fields(**_sizes(hidden, 0.2), window=SW_WINDOW, yarn_from=1024)
    spread = partial(recipes.spread_biases_and_norms, bias_suffix="_bias", sinks=True)
    _hf(folder, "GptOssConfig", "GptOssForCausalLM", fields, spread)


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
