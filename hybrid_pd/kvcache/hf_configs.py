"""Hugging Face ``config.json`` -> `ModelCacheSpec`.

Each supported ``architectures[0]`` maps, through `_REGISTRY`, to a builder that reads the
language-model settings (``text_config`` for multimodal checkpoints, else the top level) and
returns one entry per decoder layer: a layer spec, ``None`` for a layer that owns no cache
(Nemotron-H MLP / MoE blocks), or, for a layer with several cache-owning modules (Falcon-H1:
attention and Mamba2 side by side), a mapping from module name to spec. Cache layers are named
after the module that owns the cache: ``model.layers.{i}`` for a layer with one such module
(every architecture but Falcon-H1), ``model.layers.{i}.{module}`` otherwise
(``model.layers.{i}.self_attn`` and ``model.layers.{i}.mamba``, transformers' module names).

Missing fields: defaults are applied only where published checkpoints rely on the transformers
config default (Gemma 3 ``text_config`` omits heads and window, Qwen omits
``full_attention_interval``, Llama 4 leaves ``no_rope_layers`` empty, Granite/Bamba write
``mamba_d_head: "auto"``; a Mistral config without ``sliding_window`` slides over transformers'
4096 tokens, while an explicit null means full attention); any other missing size field raises
a ValueError naming the field and the architecture. Multi-token-prediction (MTP) layers are not
included.

Dtypes:
  * attention KV: the ``dtype`` argument, else the config's ``dtype`` / ``torch_dtype``
    (``text_config`` first, then top level), else bfloat16;
  * Mamba / GDN conv state: the model dtype (config ``dtype`` / ``torch_dtype``, else bfloat16),
    never the ``dtype`` argument, which only picks the KV cache format;
  * SSM / recurrent state: ``mamba_ssm_dtype`` (or Nemotron's ``mamba_ssm_cache_dtype``) when
    the config sets it, else the model dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybrid_pd.kvcache.hf_fields import Dtypes, Fields, read_dtypes
from hybrid_pd.kvcache.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    LayerSpec,
    ModelCacheSpec,
    SlidingWindowSpec,
    gdn_state_spec,
    mamba1_state_spec,
    mamba2_state_spec,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "cache_spec_from_config",
    "load_config",
]

# Old layer-type names that newer transformers releases rewrite on load.
_LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}
_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


class UnsupportedArchitectureError(ValueError):
    """``architectures[0]`` has no builder in the registry."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        super().__init__(
            f"unsupported architecture {architecture!r}; supported architectures: {supported}"
        )


# --------------------------------------------------------------------------- loading


def load_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Config dict from a dict, a ``config.json`` path, or a checkpoint folder holding one."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError(f"expected a dict or a path, got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in checkpoint folder {path}")
        path = path / "config.json"
    elif not path.is_file():
        raise FileNotFoundError(f"config file or checkpoint folder not found: {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _architecture(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures")
    if not archs or not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ValueError("config is missing required field 'architectures' (a list of names)")
    return archs[0]


def cache_spec_from_config(
    config: str | os.PathLike[str] | Mapping[str, Any], dtype: str | None = None
) -> ModelCacheSpec:
    """Per-layer cache specs of the checkpoint described by `config` (see module docstring).

    `config` is anything `load_config` accepts. `dtype` overrides the attention KV dtype only.
    Raises UnsupportedArchitectureError for an unknown ``architectures[0]`` and ValueError
    for missing or inconsistent fields.
    """
    cfg = load_config(config)
    arch = _architecture(cfg)
    entry = _REGISTRY.get(arch)
    if entry is None:
        raise UnsupportedArchitectureError(arch)
    build, defaults = entry
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), Mapping) else cfg
    fields = Fields(arch, text, defaults)
    per_layer = build(fields, read_dtypes(cfg, text, dtype))
    layers: dict[str, LayerSpec] = {}
    for i, entry in enumerate(per_layer):
        if isinstance(entry, Mapping):
            layers.update({f"model.layers.{i}.{module}": s for module, s in entry.items()})
        elif entry is not None:
            layers[f"model.layers.{i}"] = entry
    return ModelCacheSpec(
        architecture=arch, layers=layers, max_model_len=fields.opt_size("max_position_embeddings")
    )


# --------------------------------------------------------------------------- helpers


def _layer_types(f: Fields, allowed: set[str], key: str = "layer_types") -> list[str] | None:
    """The config's per-layer type list (legacy names mapped), checked; None when absent."""
    raw = f.get(key)
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ValueError(f"{f.arch}: field {key!r} must be a list, got {type(raw).__name__}")
    kinds = [_LEGACY_LAYER_TYPES.get(t, t) for t in raw]
    for i, kind in enumerate(kinds):
        if kind not in allowed:
            raise ValueError(
                f"{f.arch}: {key}[{i}] is {raw[i]!r}; expected one of {sorted(allowed)}"
            )
    if f.get("num_hidden_layers") is not None and len(kinds) != f.num_layers():
        raise ValueError(
            f"{f.arch}: {key} has {len(kinds)} entries but num_hidden_layers is {f.num_layers()}"
        )
    return kinds


def _every_nth(n_layers: int, n: int, hit: str, other: str) -> list[str]:
    """`hit` on layers i with (i + 1) % n == 0, `other` elsewhere (transformers convention)."""
    return [hit if (i + 1) % n == 0 else other for i in range(n_layers)]


def _full(f: Fields, d: Dtypes, *head_dim_aliases: str, derive: bool = True) -> FullAttentionSpec:
    return FullAttentionSpec(f.kv_heads(), f.head_dim(*head_dim_aliases, derive=derive), d.kv)


def _sliding(f: Fields, d: Dtypes, derive: bool = True) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        f.kv_heads(), f.head_dim(derive=derive), d.kv, window=f.size("sliding_window")
    )


def _map(
    kinds: list[str], makers: Mapping[str, Callable[[], LayerSpec | None]]
) -> list[LayerSpec | None]:
    """Spec per layer; each kind's spec is built once, and only if that kind occurs."""
    built = {kind: makers[kind]() for kind in dict.fromkeys(kinds)}
    return [built[kind] for kind in kinds]


def _mamba2_head_dim(f: Fields, n_heads: int) -> int:
    head_dim = f.get("mamba_d_head", "auto")
    if head_dim != "auto":
        return f.size("mamba_d_head")
    inner = f.size("hidden_size") * f.size("mamba_expand")
    if inner % n_heads:
        raise ValueError(f"{f.arch}: mamba_n_heads {n_heads} does not divide {inner}")
    return inner // n_heads


def _granite_mamba(f: Fields, d: Dtypes) -> LayerSpec:
    heads = f.size("mamba_n_heads")
    return mamba2_state_spec(
        num_heads=heads,
        head_dim=_mamba2_head_dim(f, heads),
        state_size=f.size("mamba_d_state"),
        n_groups=f.size("mamba_n_groups"),
        conv_kernel=f.size("mamba_d_conv"),
        conv_dtype=d.conv,
        ssm_dtype=d.ssm,
    )


# --------------------------------------------------------------------------- builders

_Layers = list[LayerSpec | Mapping[str, LayerSpec] | None]


def _qwen_gdn(f: Fields, d: Dtypes) -> _Layers:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers with a full-attention layer every N."""
    kinds = _layer_types(f, {"linear_attention", "full_attention"}) or _every_nth(
        f.num_layers(), f.size("full_attention_interval"), "full_attention", "linear_attention"
    )

    def gdn() -> LayerSpec:
        return gdn_state_spec(
            num_k_heads=f.size("linear_num_key_heads"),
            num_v_heads=f.size("linear_num_value_heads"),
            head_k_dim=f.size("linear_key_head_dim"),
            head_v_dim=f.size("linear_value_head_dim"),
            conv_kernel=f.size("linear_conv_kernel_dim"),
            conv_dtype=d.conv,
            ssm_dtype=d.ssm,
        )

    return _map(
        kinds, {"linear_attention": gdn, "full_attention": lambda: _full(f, d, derive=False)}
    )


def _sliding_full(f: Fields, d: Dtypes) -> _Layers:
    """Gemma 3 / gpt-oss: sliding-window layers with a full-attention layer every N."""
    kinds = _layer_types(f, {"sliding_attention", "full_attention"}) or _every_nth(
        f.num_layers(), f.size("sliding_window_pattern"), "full_attention", "sliding_attention"
    )
    return _map(
        kinds, {"sliding_attention": lambda: _sliding(f, d), "full_attention": lambda: _full(f, d)}
    )


def _mamba2_or_attention(f: Fields, d: Dtypes, kinds: list[str]) -> _Layers:
    return _map(
        kinds,
        {"linear_attention": lambda: _granite_mamba(f, d), "full_attention": lambda: _full(f, d)},
    )


def _granite_hybrid(f: Fields, d: Dtypes) -> _Layers:
    """Granite-4.0-H: ``layer_types`` of mamba / attention (no list: all Mamba2)."""
    kinds = _layer_types(f, {"linear_attention", "full_attention"})
    return _mamba2_or_attention(f, d, kinds or ["linear_attention"] * f.num_layers())


def _bamba(f: Fields, d: Dtypes) -> _Layers:
    """Bamba: attention at ``attn_layer_indices``, Mamba2 elsewhere."""
    n = f.num_layers()
    indices = f.get("attn_layer_indices") or []
    if not isinstance(indices, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in indices
    ):
        raise ValueError(f"{f.arch}: attn_layer_indices must list layer indices below {n}")
    attn = set(indices)
    kinds = ["full_attention" if i in attn else "linear_attention" for i in range(n)]
    return _mamba2_or_attention(f, d, kinds)


def _jamba(f: Fields, d: Dtypes) -> _Layers:
    """Jamba: attention where ``i % attn_layer_period == attn_layer_offset``, Mamba1 elsewhere."""
    period, offset = f.size("attn_layer_period"), f.require("attn_layer_offset")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ValueError(f"{f.arch}: attn_layer_offset must be an int in [0, {period})")
    kinds = ["full_attention" if i % period == offset else "mamba1" for i in range(f.num_layers())]

    def mamba() -> LayerSpec:
        return mamba1_state_spec(
            intermediate_size=f.size("mamba_expand") * f.size("hidden_size"),
            state_size=f.size("mamba_d_state"),
            conv_kernel=f.size("mamba_d_conv"),
            conv_dtype=d.conv,
            ssm_dtype=d.ssm,
        )

    return _map(kinds, {"mamba1": mamba, "full_attention": lambda: _full(f, d)})


def _nemotron_h(f: Fields, d: Dtypes) -> _Layers:
    """Nemotron-H: ``hybrid_override_pattern`` (or ``layers_block_type``); MLP/MoE own no cache."""
    allowed = set(_NEMOTRON_PATTERN.values())
    kinds = _layer_types(f, allowed, "layers_block_type") or _layer_types(f, allowed)
    if kinds is None:
        pattern = f.require("hybrid_override_pattern")
        bad = sorted({c for c in str(pattern) if c not in _NEMOTRON_PATTERN})
        if not isinstance(pattern, str) or bad:
            raise ValueError(f"{f.arch}: hybrid_override_pattern has unknown symbols {bad}")
        if f.get("num_hidden_layers") is not None and len(pattern) != f.num_layers():
            raise ValueError(
                f"{f.arch}: hybrid_override_pattern has {len(pattern)} layers but "
                f"num_hidden_layers is {f.num_layers()}"
            )
        kinds = [_NEMOTRON_PATTERN[c] for c in pattern]

    def mamba() -> LayerSpec:
        return mamba2_state_spec(
            num_heads=f.size("mamba_num_heads"),
            head_dim=f.size("mamba_head_dim"),
            state_size=f.size("ssm_state_size"),
            n_groups=f.size("n_groups", "mamba_n_groups"),
            conv_kernel=f.size("conv_kernel", "mamba_d_conv"),
            conv_dtype=d.conv,
            ssm_dtype=d.ssm,
        )

    makers = {
        "linear_attention": mamba,
        "full_attention": lambda: _full(f, d, "attention_head_dim"),
        "mlp": lambda: None,
        "moe": lambda: None,
    }
    return _map(kinds, makers)


def _falcon_h1(f: Fields, d: Dtypes) -> _Layers:
    """Falcon-H1: every layer runs attention and a Mamba2 mixer side by side, so each layer
    owns a KV slot (``self_attn``) and a state slot (``mamba``). The Mamba inner size is
    ``mamba_d_ssm``, or ``mamba_expand * hidden_size`` when that is null."""
    heads = f.size("mamba_n_heads")
    if "mamba_d_ssm" not in f.values:
        raise ValueError(f"{f.arch}: config is missing required field 'mamba_d_ssm'")
    inner = f.opt_size("mamba_d_ssm") or f.size("mamba_expand") * f.size("hidden_size")
    head_dim = f.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else f.size("mamba_d_head")
    if head_dim * heads != inner:
        raise ValueError(
            f"{f.arch}: mamba_n_heads {heads} x mamba_d_head {head_dim} is not the Mamba "
            f"inner size {inner}"
        )
    layer = {
        "self_attn": _full(f, d),
        "mamba": mamba2_state_spec(
            num_heads=heads,
            head_dim=head_dim,
            state_size=f.size("mamba_d_state"),
            n_groups=f.size("mamba_n_groups"),
            conv_kernel=f.size("mamba_d_conv"),
            conv_dtype=d.conv,
            ssm_dtype=d.ssm,
        ),
    }
    return [layer] * f.num_layers()


def _llama4(f: Fields, d: Dtypes) -> _Layers:
    """Llama 4: chunked local attention on RoPE layers, global full attention on NoPE layers."""
    kinds = _layer_types(f, {"chunked_attention", "full_attention"})
    if kinds is None:
        n, no_rope = f.num_layers(), f.get("no_rope_layers")
        if no_rope:  # 1 = RoPE (chunked local), 0 = NoPE (global); [] means "not set"
            if not isinstance(no_rope, list) or len(no_rope) < n:
                raise ValueError(f"{f.arch}: no_rope_layers must list at least {n} flags")
            kinds = ["chunked_attention" if flag else "full_attention" for flag in no_rope[:n]]
        else:
            interval = f.size("no_rope_layer_interval")
            kinds = _every_nth(n, interval, "full_attention", "chunked_attention")
    # An explicit null chunk size turns chunking off (every layer global).
    chunking_off = "attention_chunk_size" in f.values and f.values["attention_chunk_size"] is None

    def chunked() -> LayerSpec:
        if chunking_off:
            return _full(f, d)
        chunk = f.size("attention_chunk_size")
        return ChunkedLocalSpec(f.kv_heads(), f.head_dim(), d.kv, chunk_size=chunk)

    return _map(kinds, {"chunked_attention": chunked, "full_attention": lambda: _full(f, d)})


def _dense(f: Fields, d: Dtypes) -> _Layers:
    """Llama: every layer full attention."""
    return [_full(f, d)] * f.num_layers()


def _mistral(f: Fields, d: Dtypes) -> _Layers:
    """Mistral: sliding window on every layer when ``sliding_window`` is set, full attention
    when it is null; a config without the field gets transformers' default window (4096)."""
    if "sliding_window" not in f.values:
        f = Fields(f.arch, {**f.values, "sliding_window": _MISTRAL_WINDOW}, f.defaults)
    spec = _sliding(f, d) if f.get("sliding_window") is not None else _full(f, d)
    return [spec] * f.num_layers()


def _qwen_dense(f: Fields, d: Dtypes) -> _Layers:
    """Qwen2/Qwen3: full attention unless ``use_sliding_window`` (layers >= max_window_layers)."""
    derive = f.arch != "Qwen3ForCausalLM"  # Qwen3's head_dim is not hidden_size / heads
    kinds = _layer_types(f, {"full_attention", "sliding_attention"})
    if kinds is None:
        n = f.num_layers()
        sliding = f.get("use_sliding_window") is True and f.get("sliding_window") is not None
        first = f.size("max_window_layers") if sliding else n
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    makers = {
        "full_attention": lambda: _full(f, d, derive=derive),
        "sliding_attention": lambda: _sliding(f, d, derive=derive),
    }
    return _map(kinds, makers)


_Builder = Callable[[Fields, Dtypes], _Layers]
_QWEN_DEFAULTS = {"full_attention_interval": 4}
# transformers Gemma3TextConfig defaults that the 4B+ multimodal text_config omits.
_GEMMA3_DEFAULTS = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
}
_MAMBA2_DEFAULTS = {"mamba_d_head": "auto", "mamba_expand": 2}
_MISTRAL_WINDOW = 4096  # MistralConfig's default sliding_window
_LLAMA4_DEFAULTS = {"no_rope_layer_interval": 4, "attention_chunk_size": 8192}

_REGISTRY: dict[str, tuple[_Builder, Mapping[str, Any]]] = {
    "Qwen3_5ForConditionalGeneration": (_qwen_gdn, _QWEN_DEFAULTS),
    "Qwen3_5MoeForConditionalGeneration": (_qwen_gdn, _QWEN_DEFAULTS),
    "Qwen3_5ForCausalLM": (_qwen_gdn, _QWEN_DEFAULTS),
    "Qwen3_5MoeForCausalLM": (_qwen_gdn, _QWEN_DEFAULTS),
    "Qwen3NextForCausalLM": (_qwen_gdn, _QWEN_DEFAULTS),
    "Gemma3ForCausalLM": (_sliding_full, _GEMMA3_DEFAULTS),
    "Gemma3ForConditionalGeneration": (_sliding_full, _GEMMA3_DEFAULTS),
    "GraniteMoeHybridForCausalLM": (_granite_hybrid, _MAMBA2_DEFAULTS),
    "BambaForCausalLM": (_bamba, _MAMBA2_DEFAULTS),
    "JambaForCausalLM": (_jamba, {}),
    "NemotronHForCausalLM": (_nemotron_h, {}),
    "FalconH1ForCausalLM": (_falcon_h1, {"mamba_d_head": "auto"}),
    "GptOssForCausalLM": (_sliding_full, {"sliding_window_pattern": 2}),
    "Llama4ForConditionalGeneration": (_llama4, _LLAMA4_DEFAULTS),
    "Llama4ForCausalLM": (_llama4, _LLAMA4_DEFAULTS),
    "LlamaForCausalLM": (_dense, {}),
    "MistralForCausalLM": (_mistral, {}),
    "Qwen2ForCausalLM": (_qwen_dense, {"max_window_layers": 28}),
    "Qwen3ForCausalLM": (_qwen_dense, {"max_window_layers": 28}),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_REGISTRY)
