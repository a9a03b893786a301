"""hf_configs: config.json -> ModelCacheSpec for the supported architectures.

Expected byte counts are worked out by hand in the comments (bf16 = 2 bytes, fp32 = 4):
attention bytes_per_token = 2 (K and V) * kv_heads * head_dim * dtype bytes;
state_bytes = conv state (conv_dim * (kernel - 1)) + SSM / recurrent state.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest

from hybrid_pd.kvcache.grouping import plan_groups
from hybrid_pd.kvcache.hf_configs import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedArchitectureError,
    cache_spec_from_config,
    load_config,
)
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS
from hybrid_pd.kvcache.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    ModelCacheSpec,
    SlidingWindowSpec,
    StateSpec,
)


def real(name: str) -> dict:
    """A private deep copy, so a test may edit it."""
    return copy.deepcopy(REFERENCE_CONFIGS[name])


def kinds(spec: ModelCacheSpec) -> Counter:
    return Counter(type(s).__name__ for s in spec.layers.values())


def indices(spec: ModelCacheSpec, cls: type) -> list[int]:
    """Decoder layer index of each cache layer of class `cls` (``model.layers.{i}[.module]``)."""
    return [int(n.split(".")[2]) for n, s in spec.layers.items() if isinstance(s, cls)]


def only(spec: ModelCacheSpec, cls: type):
    """The single distinct spec of class `cls` (all such layers must be equal)."""
    found = {s for s in spec.layers.values() if isinstance(s, cls)}
    assert len(found) == 1, found
    return found.pop()


# --------------------------------------------------------------------------- every real config


@pytest.mark.parametrize("name", sorted(REFERENCE_CONFIGS))
def test_every_real_config_parses(name: str) -> None:
    cfg = REFERENCE_CONFIGS[name]
    spec = cache_spec_from_config(cfg)
    assert spec.architecture == cfg["architectures"][0]
    assert spec.architecture in SUPPORTED_ARCHITECTURES
    assert spec.shared == {}  # none of these architectures shares KV between layers
    text = cfg.get("text_config", cfg)
    n = text["num_hidden_layers"]
    assert all(name.startswith("model.layers.") for name in spec.layers)
    assert set(indices(spec, object)) <= set(range(n))


def test_supported_architectures_lists_the_registry() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == {
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "GraniteMoeHybridForCausalLM",
        "BambaForCausalLM",
        "JambaForCausalLM",
        "NemotronHForCausalLM",
        "FalconH1ForCausalLM",
        "GptOssForCausalLM",
        "Llama4ForConditionalGeneration",
        "Llama4ForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
    assert isinstance(SUPPORTED_ARCHITECTURES, tuple)


# --------------------------------------------------------------------------- Qwen GDN hybrids


def test_qwen3_next_80b() -> None:
    spec = cache_spec_from_config(real("Qwen/Qwen3-Next-80B-A3B-Instruct"))
    assert kinds(spec) == {"StateSpec": 36, "FullAttentionSpec": 12}
    # full_attention_interval 4: layers 3, 7, ..., 47 are full attention.
    assert indices(spec, FullAttentionSpec) == list(range(3, 48, 4))
    full = only(spec, FullAttentionSpec)
    assert (full.num_kv_heads, full.head_dim, full.dtype) == (2, 256, "bfloat16")
    assert full.bytes_per_token == 2 * 2 * 256 * 2 == 2048
    gdn = only(spec, StateSpec)
    # conv_dim = 2 * 16 * 128 + 32 * 128 = 8192; conv 8192 * 3 * 2 = 49_152
    # recurrent [32, 128, 128] bf16 (no mamba_ssm_dtype) = 1_048_576
    assert gdn.mamba_type == "gdn"
    assert gdn.shapes == ((8192, 3), (32, 128, 128))
    assert gdn.dtypes == ("bfloat16", "bfloat16")
    assert gdn.state_bytes == 49_152 + 1_048_576 == 1_097_728
    assert spec.max_model_len == 262144
    assert spec.state_layers == [f"model.layers.{i}" for i in range(48) if i % 4 != 3]


def test_qwen3_5_27b_dense_uses_text_config_and_fp32_ssm_state() -> None:
    spec = cache_spec_from_config(real("Qwen/Qwen3.5-27B"))
    assert spec.architecture == "Qwen3_5ForConditionalGeneration"
    assert kinds(spec) == {"StateSpec": 48, "FullAttentionSpec": 16}
    full = only(spec, FullAttentionSpec)
    assert full.bytes_per_token == 2 * 4 * 256 * 2 == 4096
    gdn = only(spec, StateSpec)
    # conv_dim = 2 * 16 * 128 + 48 * 128 = 10_240; conv 10_240 * 3 * 2 (bf16) = 61_440
    # recurrent [48, 128, 128] in float32 (mamba_ssm_dtype) = 786_432 * 4 = 3_145_728
    assert gdn.shapes == ((10240, 3), (48, 128, 128))
    assert gdn.dtypes == ("bfloat16", "float32")
    assert gdn.state_bytes == 61_440 + 3_145_728 == 3_207_168
    assert spec.max_model_len == 262144


def test_qwen3_5_35b_a3b_moe() -> None:
    spec = cache_spec_from_config(real("Qwen/Qwen3.5-35B-A3B"))
    assert spec.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert kinds(spec) == {"StateSpec": 30, "FullAttentionSpec": 10}
    assert indices(spec, FullAttentionSpec) == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert only(spec, FullAttentionSpec).bytes_per_token == 2 * 2 * 256 * 2 == 2048
    # conv 8192 * 3 * 2 = 49_152; recurrent 32 * 128 * 128 * 4 (fp32) = 2_097_152
    assert only(spec, StateSpec).state_bytes == 49_152 + 2_097_152 == 2_146_304


@pytest.mark.parametrize(
    ("source", "arch"),
    [
        ("Qwen/Qwen3.5-27B", "Qwen3_5ForCausalLM"),
        ("Qwen/Qwen3.5-35B-A3B", "Qwen3_5MoeForCausalLM"),
    ],
)
def test_qwen3_5_text_only_flat_config_matches_multimodal(source: str, arch: str) -> None:
    multimodal = cache_spec_from_config(real(source))
    flat = {**real(source)["text_config"], "architectures": [arch]}
    spec = cache_spec_from_config(flat)
    assert spec.architecture == arch
    assert spec.layers == multimodal.layers
    assert spec.max_model_len == multimodal.max_model_len


def test_qwen_layer_types_win_over_interval_and_interval_defaults_to_4() -> None:
    cfg = real("Qwen/Qwen3.5-35B-A3B")
    text = cfg["text_config"]
    text["layer_types"] = ["linear_attention", "full_attention"] * 20
    spec = cache_spec_from_config(cfg)
    assert kinds(spec) == {"StateSpec": 20, "FullAttentionSpec": 20}
    del text["layer_types"], text["full_attention_interval"]
    assert kinds(cache_spec_from_config(cfg)) == {"StateSpec": 30, "FullAttentionSpec": 10}
    text["full_attention_interval"] = 2
    assert indices(cache_spec_from_config(cfg), FullAttentionSpec) == list(range(1, 40, 2))


# --------------------------------------------------------------------------- Gemma 3


def test_gemma3_27b_multimodal() -> None:
    spec = cache_spec_from_config(real("google/gemma-3-27b-it"))
    assert spec.architecture == "Gemma3ForConditionalGeneration"
    # sliding_window_pattern defaults to 6: layers 5, 11, ..., 59 are global.
    assert kinds(spec) == {"SlidingWindowSpec": 52, "FullAttentionSpec": 10}
    assert indices(spec, FullAttentionSpec) == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    sliding = only(spec, SlidingWindowSpec)
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.window) == (16, 128, 1024)
    assert sliding.bytes_per_token == 2 * 16 * 128 * 2 == 8192
    assert only(spec, FullAttentionSpec).bytes_per_token == 8192
    assert spec.max_model_len == 131072  # Gemma3TextConfig default; the file omits it
    assert spec.state_layers == []


def test_gemma3_4b_takes_transformers_defaults_for_omitted_fields() -> None:
    spec = cache_spec_from_config(real("google/gemma-3-4b-it"))
    assert kinds(spec) == {"SlidingWindowSpec": 29, "FullAttentionSpec": 5}
    assert indices(spec, FullAttentionSpec) == [5, 11, 17, 23, 29]
    sliding = only(spec, SlidingWindowSpec)
    # num_key_value_heads=4 and head_dim=256 are Gemma3TextConfig defaults.
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.window) == (4, 256, 1024)
    assert sliding.bytes_per_token == 2 * 4 * 256 * 2 == 4096


def test_gemma3_1b_text_only() -> None:
    spec = cache_spec_from_config(real("google/gemma-3-1b-it"))
    assert kinds(spec) == {"SlidingWindowSpec": 22, "FullAttentionSpec": 4}
    sliding = only(spec, SlidingWindowSpec)
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.window) == (1, 256, 512)
    assert sliding.bytes_per_token == 2 * 1 * 256 * 2 == 1024
    assert spec.max_model_len == 32768


def test_gemma3_window_and_pattern_defaults_and_layer_types() -> None:
    text = {"num_hidden_layers": 12, "head_dim": 64, "num_key_value_heads": 2}
    spec = cache_spec_from_config({"architectures": ["Gemma3ForCausalLM"], **text})
    assert only(spec, SlidingWindowSpec).window == 4096
    assert indices(spec, FullAttentionSpec) == [5, 11]
    spec = cache_spec_from_config(
        {"architectures": ["Gemma3ForCausalLM"], **text, "sliding_window_pattern": 3}
    )
    assert indices(spec, FullAttentionSpec) == [2, 5, 8, 11]
    layer_types = ["full_attention"] * 2 + ["sliding_attention"] * 10
    spec = cache_spec_from_config(
        {"architectures": ["Gemma3ForCausalLM"], **text, "layer_types": layer_types}
    )
    assert indices(spec, FullAttentionSpec) == [0, 1]


# --------------------------------------------------------------------------- Mamba2 hybrids


def test_granite_4_h_small() -> None:
    spec = cache_spec_from_config(real("ibm-granite/granite-4.0-h-small"))
    assert kinds(spec) == {"StateSpec": 36, "FullAttentionSpec": 4}
    full = only(spec, FullAttentionSpec)
    # head_dim = 4096 / 32 = 128
    assert full.bytes_per_token == 2 * 8 * 128 * 2 == 4096
    mamba = only(spec, StateSpec)
    # conv_dim = 128 * 64 + 2 * 1 * 128 = 8448; conv 8448 * 3 * 2 = 50_688
    # ssm [128, 64, 128] bf16 = 1_048_576 * 2 = 2_097_152
    assert mamba.mamba_type == "mamba2"
    assert mamba.shapes == ((8448, 3), (128, 64, 128))
    assert mamba.state_bytes == 50_688 + 2_097_152 == 2_147_840
    assert spec.max_model_len == 131072


@pytest.mark.parametrize("d_head", ["auto", None, "missing"])
def test_granite_mamba_d_head_auto_or_missing_is_derived(d_head: object) -> None:
    cfg = real("ibm-granite/granite-4.0-h-small")
    if d_head == "missing":
        del cfg["mamba_d_head"]
    else:
        cfg["mamba_d_head"] = d_head
    # hidden_size * mamba_expand / mamba_n_heads = 4096 * 2 / 128 = 64
    assert only(cache_spec_from_config(cfg), StateSpec).shapes[1] == (128, 64, 128)


def test_granite_accepts_current_layer_type_names_and_defaults_to_all_mamba() -> None:
    cfg = real("ibm-granite/granite-4.0-h-small")
    legacy = cache_spec_from_config(cfg)
    cfg["layer_types"] = [
        {"mamba": "linear_attention", "attention": "full_attention"}[t] for t in cfg["layer_types"]
    ]
    assert cache_spec_from_config(cfg).layers == legacy.layers
    del cfg["layer_types"]
    assert kinds(cache_spec_from_config(cfg)) == {"StateSpec": 40}


def test_bamba_9b() -> None:
    spec = cache_spec_from_config(real("ibm-ai-platform/Bamba-9B"))
    assert kinds(spec) == {"StateSpec": 29, "FullAttentionSpec": 3}
    assert indices(spec, FullAttentionSpec) == [9, 18, 27]
    assert only(spec, FullAttentionSpec).bytes_per_token == 2 * 8 * 128 * 2 == 4096
    # same Mamba2 geometry as Granite-4.0-H-Small: 50_688 + 2_097_152
    assert only(spec, StateSpec).state_bytes == 2_147_840


def test_nemotron_h_8b_pattern() -> None:
    spec = cache_spec_from_config(real("nvidia/Nemotron-H-8B-Base-8K"))
    # 24 "M", 4 "*", 24 "-": the MLP layers own no cache and are absent.
    assert kinds(spec) == {"StateSpec": 24, "FullAttentionSpec": 4}
    assert len(spec.layers) == 28
    assert indices(spec, FullAttentionSpec) == [7, 18, 29, 40]
    assert "model.layers.1" not in spec.layers and "model.layers.0" in spec.layers
    full = only(spec, FullAttentionSpec)
    assert (full.num_kv_heads, full.head_dim) == (8, 128)  # head_dim from attention_head_dim
    assert full.bytes_per_token == 2 * 8 * 128 * 2 == 4096
    mamba = only(spec, StateSpec)
    # conv_dim = 128 * 64 + 2 * 8 * 128 = 10_240; conv 10_240 * 3 * 2 = 61_440
    # ssm [128, 64, 128] bf16 = 2_097_152
    assert mamba.shapes == ((10240, 3), (128, 64, 128))
    assert mamba.state_bytes == 61_440 + 2_097_152 == 2_158_592
    assert spec.max_model_len == 8192


def test_nemotron_h_moe_blocks_and_layers_block_type() -> None:
    cfg = real("nvidia/Nemotron-H-8B-Base-8K")
    cfg["hybrid_override_pattern"] = "MEM*EMM"
    cfg["num_hidden_layers"] = 7
    spec = cache_spec_from_config(cfg)
    assert sorted(indices(spec, StateSpec)) == [0, 2, 5, 6]
    assert indices(spec, FullAttentionSpec) == [3]
    del cfg["hybrid_override_pattern"]
    cfg["layers_block_type"] = ["mamba", "moe", "mamba", "attention", "moe", "mamba", "mlp"]
    spec = cache_spec_from_config(cfg)
    assert sorted(indices(spec, StateSpec)) == [0, 2, 5]
    assert indices(spec, FullAttentionSpec) == [3]


def test_nemotron_h_head_dim_falls_back_to_hidden_over_heads() -> None:
    cfg = real("nvidia/Nemotron-H-8B-Base-8K")
    del cfg["attention_head_dim"]
    cfg["num_attention_heads"] = 64  # 4096 / 64 = 64
    assert only(cache_spec_from_config(cfg), FullAttentionSpec).head_dim == 64


def test_nemotron_mamba_ssm_cache_dtype_is_honoured() -> None:
    cfg = real("nvidia/Nemotron-H-8B-Base-8K")
    cfg["mamba_ssm_cache_dtype"] = "float32"
    assert only(cache_spec_from_config(cfg), StateSpec).dtypes == ("bfloat16", "float32")


# --------------------------------------------------------------------------- Mamba1 hybrid


def test_falcon_h1_7b_both_slots_per_layer() -> None:
    """Falcon-H1 runs attention and Mamba2 side by side in every layer: each layer owns a KV
    slot (``.self_attn``) and a state slot (``.mamba``), and the grouping puts them in the KV
    and state groups like any hybrid's layers."""
    spec = cache_spec_from_config(real("tiiuae/Falcon-H1-7B-Instruct"))
    assert kinds(spec) == {"StateSpec": 44, "FullAttentionSpec": 44}
    assert list(spec.layers)[:2] == ["model.layers.0.self_attn", "model.layers.0.mamba"]
    for i in range(44):
        assert isinstance(spec.layers[f"model.layers.{i}.self_attn"], FullAttentionSpec)
        assert isinstance(spec.layers[f"model.layers.{i}.mamba"], StateSpec)
    assert "model.layers.0" not in spec.layers
    full = only(spec, FullAttentionSpec)
    assert (full.num_kv_heads, full.head_dim, full.dtype) == (2, 128, "bfloat16")
    assert full.bytes_per_token == 2 * 2 * 128 * 2 == 1024
    mamba = only(spec, StateSpec)
    # conv_dim = 24 * 128 + 2 * 1 * 256 = 3_584; conv 3_584 * 3 * 2 = 21_504
    # ssm [24, 128, 256] bf16 = 1_572_864
    assert mamba.shapes == ((3584, 3), (24, 128, 256))
    assert mamba.state_bytes == 21_504 + 1_572_864
    assert spec.max_model_len == 262144

    config = plan_groups(spec, ref_len=4096)
    by_kind = {}
    for g in config.groups:
        by_kind.setdefault(g.kind, []).extend(g.layer_names)
    assert sorted(by_kind) == ["full", "state"]
    assert sorted(by_kind["full"]) == sorted(n for n in spec.layers if n.endswith(".self_attn"))
    assert sorted(by_kind["state"]) == sorted(n for n in spec.layers if n.endswith(".mamba"))
    for name in spec.layers:  # every cache layer has exactly one group and one slot
        assert config.group_of(name).spec == spec.layers[name]


def test_falcon_h1_mamba_inner_size_and_head_dim() -> None:
    cfg = real("tiiuae/Falcon-H1-7B-Instruct")
    cfg["mamba_d_head"] = "auto"  # 3072 / 24 heads
    assert only(cache_spec_from_config(cfg), StateSpec).shapes[1] == (24, 128, 256)
    cfg["mamba_d_ssm"] = None  # null: mamba_expand * hidden_size = 6144
    assert only(cache_spec_from_config(cfg), StateSpec).shapes[1] == (24, 256, 256)
    cfg["mamba_d_head"] = 128
    with pytest.raises(ValueError, match="inner size 6144"):
        cache_spec_from_config(cfg)
    del cfg["mamba_d_ssm"]  # transformers would default to 1024; published configs set it
    with pytest.raises(ValueError, match="'mamba_d_ssm'"):
        cache_spec_from_config(cfg)


def test_jamba_v0_1() -> None:
    spec = cache_spec_from_config(real("ai21labs/Jamba-v0.1"))
    # attention where i % 8 == 4
    assert kinds(spec) == {"StateSpec": 28, "FullAttentionSpec": 4}
    assert indices(spec, FullAttentionSpec) == [4, 12, 20, 28]
    assert only(spec, FullAttentionSpec).bytes_per_token == 2 * 8 * 128 * 2 == 4096
    mamba = only(spec, StateSpec)
    # inner = 2 * 4096 = 8192; conv 8192 * 3 * 2 = 49_152; ssm 8192 * 16 * 2 = 262_144
    assert mamba.mamba_type == "mamba1"
    assert mamba.shapes == ((8192, 3), (8192, 16))
    assert mamba.state_bytes == 49_152 + 262_144 == 311_296
    assert spec.max_model_len == 262144


# --------------------------------------------------------------------------- sliding / chunked


def test_gpt_oss_20b() -> None:
    spec = cache_spec_from_config(real("openai/gpt-oss-20b"))
    assert kinds(spec) == {"SlidingWindowSpec": 12, "FullAttentionSpec": 12}
    assert indices(spec, SlidingWindowSpec) == list(range(0, 24, 2))
    sliding = only(spec, SlidingWindowSpec)
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.window) == (8, 64, 128)
    assert sliding.bytes_per_token == 2 * 8 * 64 * 2 == 2048
    assert spec.max_model_len == 131072


def test_gpt_oss_without_layer_types_alternates_starting_with_sliding() -> None:
    cfg = real("openai/gpt-oss-20b")
    with_list = cache_spec_from_config(cfg)
    del cfg["layer_types"]
    assert cache_spec_from_config(cfg).layers == with_list.layers


def test_llama4_scout() -> None:
    spec = cache_spec_from_config(real("meta-llama/Llama-4-Scout-17B-16E-Instruct"))
    # no_rope_layers == [] -> every 4th layer (3, 7, ..., 47) is a NoPE global layer.
    assert kinds(spec) == {"ChunkedLocalSpec": 36, "FullAttentionSpec": 12}
    assert indices(spec, FullAttentionSpec) == list(range(3, 48, 4))
    chunked = only(spec, ChunkedLocalSpec)
    assert (chunked.num_kv_heads, chunked.head_dim, chunked.chunk_size) == (8, 128, 8192)
    assert chunked.bytes_per_token == 2 * 8 * 128 * 2 == 4096
    assert spec.max_model_len == 10485760


def test_llama4_explicit_no_rope_layers_and_chunking_off() -> None:
    cfg = real("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    text = cfg["text_config"]
    text["no_rope_layers"] = [1, 0] * 24  # 1 = RoPE = chunked local, 0 = NoPE = global
    spec = cache_spec_from_config(cfg)
    assert indices(spec, ChunkedLocalSpec) == list(range(0, 48, 2))
    text["attention_chunk_size"] = None
    assert kinds(cache_spec_from_config(cfg)) == {"FullAttentionSpec": 48}
    text_only = {**real("meta-llama/Llama-4-Scout-17B-16E-Instruct")["text_config"]}
    text_only["architectures"] = ["Llama4ForCausalLM"]
    assert kinds(cache_spec_from_config(text_only)) == {
        "ChunkedLocalSpec": 36,
        "FullAttentionSpec": 12,
    }


# --------------------------------------------------------------------------- dense


def test_dense_models() -> None:
    llama = cache_spec_from_config(real("meta-llama/Llama-3.1-8B-Instruct"))
    assert kinds(llama) == {"FullAttentionSpec": 32}
    assert only(llama, FullAttentionSpec).bytes_per_token == 2 * 8 * 128 * 2 == 4096
    assert llama.max_model_len == 131072

    mistral = cache_spec_from_config(real("mistralai/Mistral-7B-v0.1"))
    assert kinds(mistral) == {"SlidingWindowSpec": 32}
    assert only(mistral, SlidingWindowSpec).window == 4096

    qwen2 = cache_spec_from_config(real("Qwen/Qwen2.5-7B-Instruct"))
    assert kinds(qwen2) == {"FullAttentionSpec": 28}  # use_sliding_window is false
    # head_dim = 3584 / 28 = 128
    assert only(qwen2, FullAttentionSpec).bytes_per_token == 2 * 4 * 128 * 2 == 2048

    qwen3 = cache_spec_from_config(real("Qwen/Qwen3-8B"))
    assert kinds(qwen3) == {"FullAttentionSpec": 36}
    assert qwen3.max_model_len == 40960


def test_mistral_without_sliding_window_is_full_attention() -> None:
    cfg = real("mistralai/Mistral-7B-v0.1")
    cfg["sliding_window"] = None
    assert kinds(cache_spec_from_config(cfg)) == {"FullAttentionSpec": 32}


def test_mistral_without_the_field_gets_the_transformers_default_window() -> None:
    cfg = real("mistralai/Mistral-7B-v0.1")
    del cfg["sliding_window"]
    spec = cache_spec_from_config(cfg)
    assert kinds(spec) == {"SlidingWindowSpec": 32}
    assert only(spec, SlidingWindowSpec).window == 4096  # MistralConfig's default


def test_qwen2_use_sliding_window_applies_from_max_window_layers() -> None:
    cfg = real("Qwen/Qwen2.5-7B-Instruct")
    cfg.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    spec = cache_spec_from_config(cfg)
    assert indices(spec, SlidingWindowSpec) == list(range(20, 28))


def test_missing_kv_heads_falls_back_to_attention_heads() -> None:
    cfg = real("meta-llama/Llama-3.1-8B-Instruct")
    del cfg["num_key_value_heads"]
    assert only(cache_spec_from_config(cfg), FullAttentionSpec).num_kv_heads == 32


# --------------------------------------------------------------------------- dtypes


def test_dtype_argument_changes_attention_kv_only() -> None:
    spec = cache_spec_from_config(real("Qwen/Qwen3.5-27B"), dtype="fp8")
    full = only(spec, FullAttentionSpec)
    assert full.dtype == "float8_e4m3fn"
    assert full.bytes_per_token == 2 * 4 * 256 * 1 == 2048
    assert only(spec, StateSpec).dtypes == ("bfloat16", "float32")


def test_config_dtype_sets_kv_and_conv_and_ssm() -> None:
    cfg = real("ai21labs/Jamba-v0.1")
    cfg["torch_dtype"] = "float16"
    spec = cache_spec_from_config(cfg)
    assert only(spec, FullAttentionSpec).dtype == "float16"
    assert only(spec, StateSpec).dtypes == ("float16", "float16")
    cfg["mamba_ssm_dtype"] = "float32"
    assert only(cache_spec_from_config(cfg), StateSpec).dtypes == ("float16", "float32")
    del cfg["torch_dtype"]
    cfg["dtype"] = "auto"
    assert only(cache_spec_from_config(cfg), FullAttentionSpec).dtype == "bfloat16"


def test_bad_dtype_is_a_value_error() -> None:
    cfg = real("ai21labs/Jamba-v0.1")
    cfg["torch_dtype"] = "float64"
    with pytest.raises(ValueError, match="torch_dtype"):
        cache_spec_from_config(cfg)
    with pytest.raises(ValueError, match="unknown dtype"):
        cache_spec_from_config(real("ai21labs/Jamba-v0.1"), dtype="int3")


# --------------------------------------------------------------------------- errors


def test_unknown_architecture() -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        cache_spec_from_config({"architectures": ["Zamba2ForCausalLM"]})
    message = str(info.value)
    assert "'Zamba2ForCausalLM'" in message
    assert "NemotronHForCausalLM" in message and "Qwen3_5ForConditionalGeneration" in message
    assert info.value.architecture == "Zamba2ForCausalLM"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("cfg", [{}, {"architectures": []}, {"architectures": "LlamaForCausalLM"}])
def test_missing_architectures(cfg: dict) -> None:
    with pytest.raises(ValueError, match="'architectures'"):
        cache_spec_from_config(cfg)


@pytest.mark.parametrize(
    ("name", "path", "field"),
    [
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", (), "linear_num_value_heads"),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", (), "head_dim"),
        ("Qwen/Qwen3.5-27B", ("text_config",), "linear_conv_kernel_dim"),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", (), "num_hidden_layers"),
        ("nvidia/Nemotron-H-8B-Base-8K", (), "hybrid_override_pattern"),
        ("nvidia/Nemotron-H-8B-Base-8K", (), "ssm_state_size"),
        ("ibm-granite/granite-4.0-h-small", (), "mamba_n_heads"),
        ("ibm-ai-platform/Bamba-9B", (), "mamba_d_state"),
        ("ai21labs/Jamba-v0.1", (), "attn_layer_offset"),
        ("ai21labs/Jamba-v0.1", (), "mamba_expand"),
        ("openai/gpt-oss-20b", (), "sliding_window"),
        ("Qwen/Qwen3-8B", (), "head_dim"),
        ("meta-llama/Llama-3.1-8B-Instruct", (), "hidden_size"),
    ],
)
def test_missing_required_field_names_field_and_architecture(
    name: str, path: tuple[str, ...], field: str
) -> None:
    cfg = real(name)
    section = cfg
    for key in path:
        section = section[key]
    del section[field]
    with pytest.raises(ValueError, match=f"{cfg['architectures'][0]}.*'{field}'"):
        cache_spec_from_config(cfg)


def test_inconsistent_layer_lists_are_rejected() -> None:
    cfg = real("Qwen/Qwen3.5-35B-A3B")
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:-1]
    with pytest.raises(ValueError, match="39 entries but num_hidden_layers is 40"):
        cache_spec_from_config(cfg)
    cfg = real("openai/gpt-oss-20b")
    cfg["layer_types"][3] = "linear_attention"
    with pytest.raises(ValueError, match=r"GptOssForCausalLM: layer_types\[3\]"):
        cache_spec_from_config(cfg)
    cfg = real("nvidia/Nemotron-H-8B-Base-8K")
    cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:-1] + "X"
    with pytest.raises(ValueError, match=r"unknown symbols \['X'\]"):
        cache_spec_from_config(cfg)
    cfg["hybrid_override_pattern"] = "M*"
    with pytest.raises(ValueError, match="2 layers but num_hidden_layers is 52"):
        cache_spec_from_config(cfg)
    cfg = real("ibm-ai-platform/Bamba-9B")
    cfg["attn_layer_indices"] = [9, 32]
    with pytest.raises(ValueError, match="attn_layer_indices"):
        cache_spec_from_config(cfg)


def test_non_integer_sizes_are_rejected() -> None:
    cfg = real("meta-llama/Llama-3.1-8B-Instruct")
    cfg["num_key_value_heads"] = "8"
    with pytest.raises(ValueError, match="'num_key_value_heads' must be a positive integer"):
        cache_spec_from_config(cfg)
    cfg["num_key_value_heads"] = 8.0  # integral floats are accepted
    assert only(cache_spec_from_config(cfg), FullAttentionSpec).num_kv_heads == 8


# --------------------------------------------------------------------------- loading


def test_load_from_folder_file_and_dict(tmp_path: Path) -> None:
    cfg = REFERENCE_CONFIGS["nvidia/Nemotron-H-8B-Base-8K"]
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert load_config(tmp_path) == cfg
    assert load_config(str(tmp_path / "config.json")) == cfg
    assert load_config(cfg) == cfg and load_config(cfg) is not cfg
    from_folder = cache_spec_from_config(tmp_path)
    assert from_folder == cache_spec_from_config(cfg)
    assert cache_spec_from_config(str(tmp_path), dtype="fp8").layers["model.layers.7"].dtype == (
        "float8_e4m3fn"
    )


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json in checkpoint folder"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_config(tmp_path / "absent" / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path)
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="JSON object"):
        load_config(bad)
    with pytest.raises(TypeError):
        load_config(42)  # type: ignore[arg-type]
