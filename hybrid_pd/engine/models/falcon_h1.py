"""Falcon-H1 (transformers ``FalconH1ForCausalLM``): attention and a Mamba2 mixer side by side
in every layer, with SwiGLU MLPs and muP multipliers.

Per layer, with h = input_layernorm(x):

    x += ssm_out * mamba(ssm_in * h) + attn_out * self_attn(attn_in * h)
    x += down(up(y) * act(gate_mult * gate(y))) * down_mult,   y = pre_ff_layernorm(x)

then ``final_layernorm`` and ``lm_head`` times ``lm_head_multiplier``; the embedding is
multiplied by ``embedding_multiplier``. RMS norms apply their weight after the cast back
(FalconH1RMSNorm). Every layer owns two cache layers (`kvcache.hf_configs`):
``model.layers.{i}.self_attn`` (KV) and ``model.layers.{i}.mamba`` (conv + SSM state).

Attention: GQA, full RoPE, softmax scale head_dim^-0.5; the keys are multiplied by
``key_multiplier`` before RoPE (so the cache keeps scaled keys, as transformers' does).

Mamba2 (the shared mixer, `mamba2.py`), with Falcon-H1's differences:
  * the inner size is ``mamba_d_ssm`` (``mamba_expand * hidden_size`` when null), head dim
    ``mamba_d_head`` ("auto": inner / heads);
  * the in_proj output (z | x | B | C | dt) is multiplied channel-wise by the muP vector built
    from the five ``ssm_multipliers`` (transformers' ``mup_vector``);
  * with ``mamba_rms_norm`` the output goes through a per-group gated RMSNorm, normalised
    after the gate unless ``mamba_norm_before_gate`` (then norm, weight, then the gate);
    without it, y * silu(z) and no norm;
  * in_proj has a bias with ``mamba_proj_bias``, out_proj with ``projectors_bias``.
``mamba_use_mlp`` and ``attn_layer_indices`` are ignored, as transformers ignores them (every
layer has attention, Mamba2 and the MLP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import PagedSelfAttention
from hybrid_pd.engine.models.backbone import StackCausalLM
from hybrid_pd.engine.models.common import (
    DecoderSettings,
    RMSNorm,
    activation,
    config_int,
)
from hybrid_pd.engine.models.mamba2 import (
    GatedRMSNorm,
    Mamba2Dims,
    Mamba2Mixer,
    as_float,
    check_state_spec,
)
from hybrid_pd.engine.models.rope import cos_sin, inverse_frequencies, rope_settings
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import AttentionSpec, StateSpec

_ARCH = "FalconH1"
_IGNORED = ("rotary_emb.", "mup_vector")


def _int(c: Mapping[str, Any], key: str, default: int | None = None) -> int:
    return config_int(_ARCH, key, c.get(key, default))


def _mult(c: Mapping[str, Any], key: str) -> float:
    value = c.get(key)
    return 1.0 if value is None else as_float(value)


def _mults(c: Mapping[str, Any], key: str, n: int) -> list[float]:
    value = c.get(key)
    if value is None:
        return [1.0] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{_ARCH}: config field {key!r} must list {n} numbers, got {value!r}")
    return [as_float(v) for v in value]


class _Settings(DecoderSettings):
    """A Falcon-H1 config dict, validated, with FalconH1Config's defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        c = config.get("text_config") or config
        self.read_decoder(_ARCH, c, vocab=128000, eps=1e-5)
        self.num_layers = _int(c, "num_hidden_layers", 32)
        self.attn_bias = bool(c.get("attention_bias") or False)
        self.mlp_bias = bool(c.get("mlp_bias") or False)
        self.out_bias = bool(c.get("projectors_bias") or False)
        self.embedding_mult = _mult(c, "embedding_multiplier")
        self.lm_head_mult = _mult(c, "lm_head_multiplier")
        self.key_mult = _mult(c, "key_multiplier")
        self.attn_in, self.attn_out = (
            _mult(c, "attention_in_multiplier"),
            _mult(c, "attention_out_multiplier"),
        )
        self.ssm_in, self.ssm_out = _mult(c, "ssm_in_multiplier"), _mult(c, "ssm_out_multiplier")
        self.mlp_gate_mult, self.mlp_down_mult = _mults(c, "mlp_multipliers", 2)
        self.ssm_mults = _mults(c, "ssm_multipliers", 5)
        self.rms_norm = bool(c.get("mamba_rms_norm") or False)
        norm_before_gate = c.get("mamba_norm_before_gate")
        self.norm_before_gate = True if norm_before_gate is None else bool(norm_before_gate)

        specs = cache_spec_from_config(dict(config), dtype="float32").layers
        self.attn_specs = [specs[f"model.layers.{i}.self_attn"] for i in range(self.num_layers)]
        self.state_specs = [specs[f"model.layers.{i}.mamba"] for i in range(self.num_layers)]
        for i, (a, m) in enumerate(zip(self.attn_specs, self.state_specs, strict=True)):
            if not isinstance(a, AttentionSpec) or not isinstance(m, StateSpec):
                raise ValueError(f"{_ARCH}: layer {i} has unexpected cache specs {a!r}, {m!r}")

        inner = c.get("mamba_d_ssm", 1024)
        inner = int((c.get("mamba_expand") or 2) * self.hidden) if inner is None else int(inner)
        self.mamba = Mamba2Dims.from_mamba_keys(
            _ARCH, c, self.hidden, (inner, "mamba_d_ssm"), self.eps, self.act
        )
        self.head_dim = self.attn_specs[0].head_dim
        self.rope = rope_settings(c, _ARCH)

    def mup_vector(self) -> torch.Tensor:
        """Channel multipliers of the packed in_proj output: z, x, B, C, dt."""
        d = self.mamba
        gn = d.groups * d.state
        sizes = (d.inner, d.inner, gn, gn, d.heads)
        return torch.cat([torch.full((n,), m) for n, m in zip(sizes, self.ssm_mults, strict=True)])


class NormThenGate(GatedRMSNorm):
    """Per-group RMSNorm of y, times its weight, then times silu(z) (norm before the gate)."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = y.float().unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * g.flatten(-2)) * F.silu(z.float())


class FalconMamba2(Mamba2Mixer):
    """The shared Mamba2 mixer with Falcon-H1's muP vector on in_proj, its optional norm
    (checkpoint name ``norm.weight`` only with ``mamba_rms_norm``) and out_proj bias."""

    def __init__(self, s: _Settings, name: str) -> None:
        super().__init__(s.mamba, name)
        d = s.mamba
        self.out_proj = nn.Linear(d.inner, d.hidden, bias=s.out_bias)
        if not s.rms_norm:
            self.norm = None
        elif s.norm_before_gate:
            self.norm = NormThenGate(d.inner, d.inner // d.groups, d.eps)
        self.register_buffer("mup", s.mup_vector(), persistent=False)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return self.in_proj(h) * self.mup

    def gate_and_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return y * F.silu(z.float())
        return self.norm(y, z)


class FalconMLP(nn.Module):
    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=s.mlp_bias)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=s.mlp_bias)
        self.act = activation(s.act)
        self.gate_mult, self.down_mult = s.mlp_gate_mult, s.mlp_down_mult

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act(self.gate_proj(x) * self.gate_mult)
        return self.down_proj(y) * self.down_mult


class DecoderLayer(nn.Module):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__()
        prefix = f"model.layers.{idx}"
        check_state_spec(s.mamba, s.state_specs[idx], f"{prefix}.mamba", _ARCH)
        self.s = s
        self.input_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)
        self.pre_ff_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)
        self.feed_forward = FalconMLP(s)
        self.mamba = FalconMamba2(s, f"{prefix}.mamba")
        self.self_attn = PagedSelfAttention(
            f"{prefix}.self_attn",
            s.hidden,
            s.num_heads,
            s.attn_specs[idx],
            bias=s.attn_bias,
            rotary_dim=s.head_dim,
            key_multiplier=s.key_mult,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rot) -> torch.Tensor:
        s = self.s
        h = self.input_layernorm(x)
        m = self.mamba(h * s.ssm_in, batch) * s.ssm_out
        a = self.self_attn(h * s.attn_in, batch, rot) * s.attn_out
        x = x + (m + a)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1ForCausalLM(StackCausalLM):
    arch, ignored = _ARCH, _IGNORED

    def __init__(self, config: dict) -> None:
        s = _Settings(config)
        super().__init__(s, lambda i: DecoderLayer(s, i), s.num_layers)
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.model.inv_freq, self.model.rope_scale = inverse_frequencies(s.rope, s.head_dim)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return super().embed(batch) * self.settings.embedding_mult

    def layer_inputs(self, batch: ForwardBatch, x: torch.Tensor) -> tuple:
        positions = batch.positions.to(x.device)
        return batch, cos_sin(self.model.inv_freq, positions, self.model.rope_scale, x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.settings.lm_head_mult
