"""Per-layer memory specs.

A spec describes what one layer keeps between steps. Attention specs are block-size free:
the grouping step chooses the block size (tokens per block) for the whole pool and asks each
spec for its page bytes at that size. State specs (Mamba1, Mamba2, Gated DeltaNet) hold one
fixed-size state per request, whatever its length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype(name: str) -> str:
    """Canonical dtype name ("bf16" -> "bfloat16", "torch.float16" -> "float16")."""
    key = str(name).lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in _DTYPE_BYTES:
        known = ", ".join(sorted(set(_DTYPE_BYTES) | set(_DTYPE_ALIASES)))
        raise ValueError(f"unknown dtype {name!r}; known: {known}")
    return key


def dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES[normalize_dtype(name)]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerSpec:
    """Base of all layer specs."""

    #: Short type label used in reports ("full", "sliding_window", ...).
    kind = "base"

    def page_bytes(self, block_size: int) -> int:
        """Bytes this layer stores in one block of `block_size` tokens."""
        raise NotImplementedError

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Non-null blocks a request holds after `num_tokens` tokens were computed."""
        raise NotImplementedError

    def first_needed_token(self, num_tokens: int) -> int:
        """Earliest token position still read when computing position `num_tokens`."""
        return 0


@dataclass(frozen=True)
class AttentionSpec(LayerSpec):
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    #: The field that bounds how far back a query sees (a window, a chunk), if the kind
    #: has one: it must be positive.
    span_field = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"{type(self).__name__}: heads and head_dim must be positive")
        if self.span_field and getattr(self, self.span_field) <= 0:
            raise ValueError(f"{type(self).__name__}.{self.span_field} must be positive")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token for one layer."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        if num_tokens <= 0:
            return 0
        first = self.first_needed_token(num_tokens) // block_size
        return cdiv(num_tokens, block_size) - first

    def as_full(self) -> FullAttentionSpec:
        return FullAttentionSpec(self.num_kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    kind = "full"


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Each query sees itself and the `window - 1` tokens before it."""

    window: int = 0
    kind = "sliding_window"
    span_field = "window"

    def first_needed_token(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window + 1)


@dataclass(frozen=True)
class ChunkedLocalSpec(AttentionSpec):
    """Llama 4 style local attention: a query sees only earlier tokens of its own chunk."""

    chunk_size: int = 0
    kind = "chunked_local"
    span_field = "chunk_size"

    def first_needed_token(self, num_tokens: int) -> int:
        return (num_tokens // self.chunk_size) * self.chunk_size


@dataclass(frozen=True)
class StateSpec(LayerSpec):
    """Recurrent state of a Mamba1 / Mamba2 / Gated DeltaNet layer.

    `shapes[i]` and `dtypes[i]` describe the i-th state tensor of one request (for Mamba2 and
    GDN: the conv state, then the SSM / recurrent state). The tensors are stored back to back
    in one state page.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    mamba_type: str = "mamba2"
    #: Per state tensor, how its rows (dim 0) split over tensor-parallel ranks: segments
    #: of (units, rows per unit, replicated when fewer units than ranks), as
    #: `engine.tp.shard.Seg` splits the weights that write them. Empty: not described
    #: (such a state moves only between TP groups of equal size).
    row_splits: tuple[tuple[tuple[int, int, bool], ...], ...] = ()
    kind = "state"

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ValueError("StateSpec needs one dtype per state shape")
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(normalize_dtype(d) for d in self.dtypes))
        if self.mamba_type not in ("mamba1", "mamba2", "gdn"):
            raise ValueError(f"unknown mamba_type {self.mamba_type!r}")
        if self.row_splits:
            if len(self.row_splits) != len(self.shapes):
                raise ValueError("StateSpec needs one row split per state tensor")
            for shape, segs in zip(self.shapes, self.row_splits, strict=True):
                if sum(units * width for units, width, _ in segs) != shape[0]:
                    raise ValueError(f"row split {segs} does not cover {shape[0]} rows")

    @property
    def state_bytes(self) -> int:
        pairs = zip(self.shapes, self.dtypes, strict=True)
        return sum(math.prod(s) * dtype_bytes(d) for s, d in pairs)

    def page_bytes(self, block_size: int) -> int:
        return self.state_bytes

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        return 1 if num_tokens > 0 else 0

    def first_needed_token(self, num_tokens: int) -> int:
        return num_tokens


def mamba2_state_spec(
    *,
    num_heads: int,
    head_dim: int,
    state_size: int,
    n_groups: int,
    conv_kernel: int,
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "bfloat16",
) -> StateSpec:
    """Mamba2: conv over (x, B, C) channels; SSM state [heads, head_dim, state_size]."""
    conv_dim = num_heads * head_dim + 2 * n_groups * state_size
    return StateSpec(
        shapes=((conv_dim, conv_kernel - 1), (num_heads, head_dim, state_size)),
        dtypes=(conv_dtype, ssm_dtype),
        mamba_type="mamba2",
        row_splits=(
            (
                (num_heads, head_dim, False),
                (n_groups, state_size, True),
                (n_groups, state_size, True),
            ),
            ((num_heads, 1, False),),
        ),
    )


def mamba1_state_spec(
    *,
    intermediate_size: int,
    state_size: int,
    conv_kernel: int,
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "bfloat16",
) -> StateSpec:
    """Mamba1 (Jamba): conv over the inner channels; SSM state [inner, state_size]."""
    return StateSpec(
        shapes=((intermediate_size, conv_kernel - 1), (intermediate_size, state_size)),
        dtypes=(conv_dtype, ssm_dtype),
        mamba_type="mamba1",
        row_splits=(((intermediate_size, 1, False),), ((intermediate_size, 1, False),)),
    )


def gdn_state_spec(
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
    conv_dtype: str = "bfloat16",
    ssm_dtype: str = "bfloat16",
) -> StateSpec:
    """Gated DeltaNet: conv over (q, k, v) channels; recurrent state [v_heads, k_dim, v_dim]."""
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    return StateSpec(
        shapes=((conv_dim, conv_kernel - 1), (num_v_heads, head_k_dim, head_v_dim)),
        dtypes=(conv_dtype, ssm_dtype),
        mamba_type="gdn",
        row_splits=(
            (
                (num_k_heads, head_k_dim, False),
                (num_k_heads, head_k_dim, False),
                (num_v_heads, head_v_dim, False),
            ),
            ((num_v_heads, 1, False),),
        ),
    )


@dataclass(frozen=True)
class ModelCacheSpec:
    """Every cache-owning layer of a model, in model order, plus layers that reuse another's KV.

    `layers` maps layer name -> spec. `shared` maps a layer that owns no cache to the layer
    whose KV it reads (e.g. Gemma 3n's KV-sharing layers); such layers are not in `layers`.
    """

    architecture: str
    layers: dict[str, LayerSpec]
    shared: dict[str, str] = None  # type: ignore[assignment]
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.shared is None:
            object.__setattr__(self, "shared", {})
        if not self.layers:
            raise ValueError(f"{self.architecture}: no layer owns a KV cache")
        for name, target in self.shared.items():
            if target not in self.layers:
                raise ValueError(f"layer {name} shares KV with {target}, which owns no cache")

    @property
    def state_layers(self) -> list[str]:
        return [n for n, s in self.layers.items() if isinstance(s, StateSpec)]

    def with_dtype(self, dtype: str) -> ModelCacheSpec:
        """Same layers with attention KV stored in `dtype` (state dtypes are kept)."""
        from dataclasses import replace

        layers = {
            n: replace(s, dtype=dtype) if isinstance(s, AttentionSpec) else s
            for n, s in self.layers.items()
        }
        return replace(self, layers=layers)
