"""Rotary position embedding parameters of a config, as transformers resolves them.

Supported `rope_type`s: ``default``, ``linear`` (positions divided by `factor`), ``llama3``
(Llama 3.1: low frequencies divided by `factor`, a smooth blend between `low_freq_factor` and
`high_freq_factor`) and ``yarn`` (blend of interpolated and original frequencies between the
`beta_fast` / `beta_slow` correction dims, cos and sin scaled by an attention factor).
``dynamic`` and ``longrope`` are refused: they change the frequencies with the length of the
sequence in one forward call, which a paged engine that runs prompts in chunks cannot
reproduce token for token.

Where the parameters come from (transformers 5 resolution order): ``rope_scaling`` if set,
else ``rope_parameters``; ``rope_theta`` from that dict, else the top-level ``rope_theta``,
else 10000; ``rope_type`` from the dict, else its legacy ``type`` key, else ``default``;
``original_max_position_embeddings`` (llama3, yarn) from the top level if set there, else the
dict, else ``max_position_embeddings``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pd.engine import cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DEFAULT_THETA = 10_000.0


@dataclass(frozen=True)
class RopeSettings:
    """One RoPE: its inverse frequencies follow from these and the head dim."""

    rope_type: str
    theta: float
    params: Mapping[str, Any]
    max_position_embeddings: int | None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.params.get(key)
        return default if value is None else value


def rope_settings(config: Mapping[str, Any], arch: str) -> RopeSettings:
    """The RoPE of a (text) config dict; raises NotImplementedError for a type we refuse."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = params.get("rope_theta", config.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"{arch}: rope_type {kind!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise NotImplementedError(f"{arch}: partial_rotary_factor {partial} is not supported")
    max_pos = config.get("max_position_embeddings")
    if config.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    if kind in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_pos)
        if params["original_max_position_embeddings"] is None:
            raise ValueError(f"{arch}: {kind} RoPE needs original_max_position_embeddings")
    return RopeSettings(
        rope_type=kind,
        theta=_DEFAULT_THETA if theta is None else theta,
        params=params,
        max_position_embeddings=max_pos,
    )


def inverse_frequencies(rope: RopeSettings, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention factor that scales cos and sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = rope.theta**exponents
    inv = 1.0 / base
    if rope.rope_type == "default":
        return inv, 1.0
    if rope.rope_type == "linear":
        return inv / float(rope.params["factor"]), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv), 1.0
    return _yarn(rope, base, head_dim)


def _llama3(rope: RopeSettings, inv: torch.Tensor) -> torch.Tensor:
    """Wavelengths shorter than old_len / high_freq_factor are kept, longer than
    old_len / low_freq_factor divided by `factor`, those between blended linearly in
    old_len / wavelength."""
    factor = float(rope.params["factor"])
    low, high = float(rope.params["low_freq_factor"]), float(rope.params["high_freq_factor"])
    old_len = rope.params["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > old_len / low, inv / factor, inv)
    blend = (old_len / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    between = (wavelength >= old_len / high) & (wavelength <= old_len / low)
    return torch.where(between, smoothed, scaled)


def _yarn(rope: RopeSettings, base: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, float]:
    old_len = rope.params["original_max_position_embeddings"]
    factor = rope.params.get("factor")
    if factor is None:  # DeepSeek-style: the ratio of the two lengths
        factor = rope.max_position_embeddings / old_len
    attention = rope.params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = rope.params.get("mscale"), rope.params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    fast, slow = rope.get("beta_fast", 32), rope.get("beta_slow", 1)

    def dim_of(rotations: float) -> float:
        """The dim whose wavelength fits `rotations` times into the original length."""
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    lo, hi = dim_of(fast), dim_of(slow)
    if rope.params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: original frequency (extrapolate), 0: divided by factor
    inv = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv, float(attention)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] for the rotate-half layout, computed in float32 and
    cast to `dtype` (as transformers does)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos / sin [T, 1, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def norm_rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.nn.Module | None = None
) -> torch.Tensor:
    """`rotate(norm(x), cos, sin)` on the first cos.shape[-1] dims of each head, the rest
    as they are: x [T, H, D] (a view of a fused projection's output), `norm` an RMSNorm over
    D or None. On the CPU in float32 one C pass (`cpu_kernels.norm_rope`) where PyTorch
    takes about ten operations: the same formula, within float32 rounding."""
    if norm is None:
        out = cpu_kernels.norm_rope(x, cos, sin)
    else:
        out = cpu_kernels.norm_rope(x, cos, sin, norm.weight, norm.eps, norm.offset)
    if out is not None:
        return out
    if norm is not None:
        x = norm(x)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat([rotate(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
