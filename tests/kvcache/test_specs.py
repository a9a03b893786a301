"""Layer specs: bytes per token, state sizes, blocks needed, dtype names."""

from __future__ import annotations

import pytest

from hybrid_pd.kvcache.specs import (
    ChunkedLocalSpec,
    FullAttentionSpec,
    ModelCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    cdiv,
    dtype_bytes,
    gdn_state_spec,
    mamba1_state_spec,
    mamba2_state_spec,
    normalize_dtype,
)

# -- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "canonical", "size"),
    [
        ("bf16", "bfloat16", 2),
        ("BF16", "bfloat16", 2),
        ("torch.bfloat16", "bfloat16", 2),
        ("fp16", "float16", 2),
        ("half", "float16", 2),
        ("torch.float16", "float16", 2),
        ("float", "float32", 4),
        ("fp32", "float32", 4),
        ("fp8", "float8_e4m3fn", 1),
        ("fp8_e5m2", "float8_e5m2", 1),
        ("int8", "int8", 1),
        ("uint8", "uint8", 1),
    ],
)
def test_dtype_normalisation(name: str, canonical: str, size: int) -> None:
    assert normalize_dtype(name) == canonical
    assert dtype_bytes(name) == size


@pytest.mark.parametrize("bad", ["float64", "int4", "", "torch.complex64"])
def test_unknown_dtype_is_rejected_with_the_known_names(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown dtype") as err:
        normalize_dtype(bad)
    assert "bfloat16" in str(err.value) and "bf16" in str(err.value)
    with pytest.raises(ValueError):
        FullAttentionSpec(1, 8, bad)
    with pytest.raises(ValueError):
        StateSpec(shapes=((2,),), dtypes=(bad,))


def test_specs_store_the_canonical_dtype() -> None:
    assert FullAttentionSpec(2, 64, "bf16") == FullAttentionSpec(2, 64, "bfloat16")
    assert StateSpec(((2, 3),), ("fp32",)).dtypes == ("float32",)


def test_cdiv() -> None:
    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


# -- attention ------------------------------------------------------------------------------


def test_attention_bytes_per_token_and_page_bytes() -> None:
    spec = FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype="bf16")
    assert spec.bytes_per_token == 2 * 8 * 128 * 2 == 4096
    assert spec.page_bytes(16) == 16 * 4096
    assert FullAttentionSpec(2, 256, "fp8").bytes_per_token == 2 * 2 * 256 * 1
    assert FullAttentionSpec(1, 4, "float32").page_bytes(3) == 3 * 2 * 4 * 4


@pytest.mark.parametrize(("heads", "dim"), [(0, 8), (8, 0), (-1, 8)])
def test_attention_rejects_non_positive_shapes(heads: int, dim: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        FullAttentionSpec(heads, dim)


def test_window_and_chunk_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(1, 8, window=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedLocalSpec(1, 8, chunk_size=0)


@pytest.mark.parametrize(
    ("tokens", "expected"), [(0, 0), (1, 1), (16, 1), (17, 2), (112, 7), (4096, 256)]
)
def test_full_attention_blocks_needed(tokens: int, expected: int) -> None:
    assert FullAttentionSpec(1, 8).blocks_needed(tokens, 16) == expected
    assert FullAttentionSpec(1, 8).first_needed_token(tokens) == 0


@pytest.mark.parametrize(
    ("tokens", "first", "expected"),
    [
        (0, 0, 0),
        (1, 0, 1),
        (32, 1, 2),  # positions 1..32 are read next: blocks 0 and 1 (block 2 not yet held)
        (33, 2, 3),  # 2..33 are read: blocks 0..2 all still hold some of them
        (47, 16, 2),  # 16..47: blocks 1, 2
        (48, 17, 2),
        (112, 81, 2),  # the vLLM design doc example
        (113, 82, 3),  # 82..113 spans blocks 5, 6, 7
    ],
)
def test_sliding_window_blocks_needed(tokens: int, first: int, expected: int) -> None:
    spec = SlidingWindowSpec(1, 8, window=32)
    assert spec.first_needed_token(tokens) == first
    assert spec.blocks_needed(tokens, 16) == expected


def test_sliding_window_smaller_than_a_block() -> None:
    spec = SlidingWindowSpec(1, 8, window=4)
    # After 20 tokens, position 20 reads 17..20: only block 1 (16..31) of the held ones.
    assert spec.blocks_needed(20, 16) == 1
    assert spec.blocks_needed(16, 16) == 1  # reads 13..16: block 0 only


@pytest.mark.parametrize(
    ("tokens", "first", "expected"),
    [(0, 0, 0), (10, 0, 3), (16, 16, 0), (17, 16, 1), (31, 16, 4), (32, 32, 0), (40, 32, 2)],
)
def test_chunked_local_blocks_needed(tokens: int, first: int, expected: int) -> None:
    spec = ChunkedLocalSpec(1, 8, chunk_size=16)
    assert spec.first_needed_token(tokens) == first
    assert spec.blocks_needed(tokens, 4) == expected


def test_as_full_keeps_the_kv_shape() -> None:
    sw = SlidingWindowSpec(4, 64, "fp16", window=128)
    full = sw.as_full()
    assert type(full) is FullAttentionSpec
    assert (full.num_kv_heads, full.head_dim, full.dtype) == (4, 64, "float16")
    assert full.bytes_per_token == sw.bytes_per_token


# -- states ---------------------------------------------------------------------------------


def test_gdn_state_bytes_by_hand() -> None:
    spec = gdn_state_spec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4)
    conv_dim = 2 * 2 * 8 + 4 * 6  # q and k over k heads, v over v heads = 56
    assert spec.shapes == ((conv_dim, 3), (4, 8, 6))
    assert spec.dtypes == ("bfloat16", "bfloat16")
    assert spec.mamba_type == "gdn"
    assert spec.state_bytes == 56 * 3 * 2 + 4 * 8 * 6 * 2 == 720
    fp32 = gdn_state_spec(
        num_k_heads=2,
        num_v_heads=4,
        head_k_dim=8,
        head_v_dim=6,
        conv_kernel=4,
        ssm_dtype="float32",
    )
    assert fp32.state_bytes == 336 + 4 * 8 * 6 * 4 == 1104


def test_qwen3_next_like_gdn_state_bytes() -> None:
    spec = gdn_state_spec(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4
    )
    assert spec.state_bytes == (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 2
    assert spec.state_bytes == 1_097_728


def test_mamba2_state_bytes_by_hand() -> None:
    spec = mamba2_state_spec(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4)
    conv_dim = 4 * 8 + 2 * 2 * 16  # x plus B and C per group = 96
    assert spec.shapes == ((conv_dim, 3), (4, 8, 16))
    assert spec.mamba_type == "mamba2"
    assert spec.state_bytes == 96 * 3 * 2 + 4 * 8 * 16 * 2 == 1600


def test_mamba1_state_bytes_by_hand() -> None:
    spec = mamba1_state_spec(intermediate_size=64, state_size=16, conv_kernel=4, ssm_dtype="fp32")
    assert spec.shapes == ((64, 3), (64, 16))
    assert spec.dtypes == ("bfloat16", "float32")
    assert spec.mamba_type == "mamba1"
    assert spec.state_bytes == 64 * 3 * 2 + 64 * 16 * 4 == 4480


def test_state_spec_page_and_blocks_needed_ignore_length() -> None:
    spec = StateSpec(((3, 5), (7,)), ("fp16", "fp32"))
    assert spec.state_bytes == 3 * 5 * 2 + 7 * 4
    assert spec.page_bytes(1) == spec.page_bytes(64) == spec.state_bytes
    assert [spec.blocks_needed(n, 16) for n in (0, 1, 16, 100_000)] == [0, 1, 1, 1]


def test_state_spec_validation() -> None:
    with pytest.raises(ValueError, match="one dtype per state shape"):
        StateSpec(((2,), (3,)), ("bf16",))
    with pytest.raises(ValueError, match="one dtype per state shape"):
        StateSpec((), ())
    with pytest.raises(ValueError, match="mamba_type"):
        StateSpec(((2,),), ("bf16",), mamba_type="rwkv")


# -- model spec -----------------------------------------------------------------------------


def test_model_cache_spec_validation_and_helpers() -> None:
    fa = FullAttentionSpec(2, 64)
    st = StateSpec(((4,),), ("fp32",))
    with pytest.raises(ValueError, match="no layer owns"):
        ModelCacheSpec("empty", {})
    with pytest.raises(ValueError, match="owns no cache"):
        ModelCacheSpec("bad", {"a": fa}, shared={"b": "missing"})
    model = ModelCacheSpec("m", {"a": fa, "s": st}, shared={"b": "a"})
    assert model.state_layers == ["s"]
    assert ModelCacheSpec("m", {"a": fa}).shared == {}
    fp8 = model.with_dtype("fp8")
    assert fp8.layers["a"].dtype == "float8_e4m3fn"  # type: ignore[attr-defined]
    assert fp8.layers["s"] == st  # state dtypes are kept
    assert fp8.shared == {"b": "a"}
