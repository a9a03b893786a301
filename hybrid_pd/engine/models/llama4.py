"""Llama 4's language model (transformers ``Llama4ForCausalLM``, and the text side of
``Llama4ForConditionalGeneration`` checkpoints) on the paged KV cache.

Per layer: x += o_proj(attention(input_layernorm(x))); x += feed_forward(post_attention_
layernorm(x)), RMS norms with the weight applied after the cast back (as transformers).

Attention (GQA, softmax scale head_dim^-0.5, biases when ``attention_bias``):

  * RoPE layers (``no_rope_layers[i]`` = 1; when the list is absent or empty, every layer but
    each ``no_rope_layer_interval``-th): RoPE from `rope.py` (Scout ships llama3 scaling),
    applied as a complex rotation of ADJACENT pairs (dims 2j, 2j+1), not of halves, in
    float32; then, with ``use_qk_norm``, a weightless L2 (RMS) norm of q and k per head;
  * NoPE layers: no rotation, no q/k norm; with ``attn_temperature_tuning`` the queries are
    scaled by 1 + attn_scale * log1p(floor((position + 1) / floor_scale)) at the token's
    absolute position;
  * which layers attend in local chunks, and the chunk size, is read from the layer cache
    specs (`kvcache.hf_configs`: chunked local on the RoPE layers, full on the NoPE layers,
    or as ``layer_types`` says; all full when ``attention_chunk_size`` is null), so attention
    reads exactly what the cache keeps (a query sees the earlier tokens of its own chunk).

Feed forward: a MoE on the layers of ``moe_layers`` (default every
``interleave_moe_layer_step``-th, counted from step - 1), a SwiGLU MLP of width
``intermediate_size_mlp`` elsewhere. MoE: router logits = x W^T (no bias); the top k logits
pass a sigmoid (the others weigh 0); each chosen expert gets the token multiplied by its score
(the score scales the expert's INPUT, not its output): out = (up * silu(gate)) W_down with
gate, up the two halves of x W_gu; plus a shared SwiGLU expert on every token.

Checkpoint names are transformers' (what ``save_pretrained`` writes): ``feed_forward.experts.
gate_up_proj`` [E, hidden, 2I] (gate columns first, then up), ``experts.down_proj``
[E, I, hidden], ``feed_forward.router.weight``, ``feed_forward.shared_expert.*``. The
parameters here keep those names but hold the expert matrices as [E, out, in] (the layout of
`onednn.linear`), transposed once, at load. A multimodal checkpoint's ``language_model.model.``
/ ``language_model.lm_head.`` tensors are the text model's; ``vision_model.`` and
``multi_modal_projector.`` tensors are skipped (text only).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import AttentionProjections, head_sizes
from hybrid_pd.engine.models.backbone import RopeCausalLM, attention_geometry, routed_experts
from hybrid_pd.engine.models.common import (
    GatedMLP,
    RMSNorm,
    activation,
    add_routed,
    check_transposed,
    config_int,
)
from hybrid_pd.engine.models.rope import rope_settings
from hybrid_pd.engine.onednn import linear
from hybrid_pd.engine.paged_attention import paged_attention
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import AttentionSpec, ChunkedLocalSpec

_ARCH = "llama4"
_DEFAULT_THETA = 500_000.0  # Llama4TextConfig.default_theta
# Checkpoint prefixes of the language model, longest first.
_PREFIXES = (
    ("language_model.model.", "model."),  # Llama4ForConditionalGeneration
    ("language_model.lm_head.", "lm_head."),
    ("model.", "model."),
    ("lm_head.", "lm_head."),
)
_IGNORED = ("vision_model.", "multi_modal_projector.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _int(c: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = c.get(key)
    return config_int(_ARCH, key, default if value is None else value)


class _Settings:
    """A Llama 4 (text) config dict, validated, with Llama4TextConfig's defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        text = config.get("text_config")
        c = dict(text if isinstance(text, Mapping) else config)
        self.vocab = _int(c, "vocab_size", 202048)
        self.hidden = _int(c, "hidden_size", 5120)
        self.intermediate = _int(c, "intermediate_size", 8192)
        self.intermediate_mlp = _int(c, "intermediate_size_mlp", 16384)
        self.num_heads = _int(c, "num_attention_heads", 40)
        self.num_experts, self.top_k = routed_experts(_ARCH, partial(_int, c), 16, 1)
        self.eps = float(c.get("rms_norm_eps") or 1e-5)
        self.act = c.get("hidden_act") or "silu"
        activation(self.act)  # unknown activations fail here, at construction
        tie = c.get("tie_word_embeddings")
        self.tie = bool(config.get("tie_word_embeddings") if tie is None else tie)
        self.attention_bias = bool(c.get("attention_bias") or False)
        self.qk_norm = bool(c.get("use_qk_norm", True))
        self.temperature_tuning = bool(c.get("attn_temperature_tuning", True))
        self.floor_scale = float(c.get("floor_scale") or 8192)
        self.attn_scale = float(0.1 if c.get("attn_scale") is None else c["attn_scale"])
        n = _int(c, "num_hidden_layers", 48)
        self.use_rope = self._rope_flags(c, n)
        self.moe_layers = self._moe_layers(c, n)
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        if rope.get("rope_theta") is None and c.get("rope_theta") is None:
            c["rope_theta"] = _DEFAULT_THETA
        self.rope = rope_settings(c, _ARCH)
        specs = cache_spec_from_config(dict(config), dtype="float32").layers
        self.specs: list[AttentionSpec] = [specs[f"model.layers.{i}"] for i in range(n)]
        self.head_dim, self.num_kv_heads = attention_geometry(_ARCH, self.specs)
        # Llama4TextConfig's own rules (an absent head_dim is 128, an absent KV head count 8)
        # differ from the planner's generic ones: refuse a config where they disagree.
        want_dim = c.get("head_dim", 128) or self.hidden // self.num_heads
        want_kv = c.get("num_key_value_heads", 8) or self.num_heads
        if (self.head_dim, self.num_kv_heads) != (want_dim, want_kv):
            raise ValueError(
                f"{_ARCH}: the cache planner reads head_dim {self.head_dim} and "
                f"{self.num_kv_heads} KV heads, transformers {want_dim} and {want_kv}; "
                "give head_dim and num_key_value_heads in the config"
            )
        if self.head_dim % 2:
            raise ValueError(f"{_ARCH}: head_dim {self.head_dim} is odd (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{_ARCH}: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @staticmethod
    def _rope_flags(c: Mapping[str, Any], n: int) -> list[bool]:
        """Which layers use RoPE: ``no_rope_layers`` (1 = RoPE), or when it is absent or
        empty, every layer but each ``no_rope_layer_interval``-th (transformers' rule)."""
        flags = c.get("no_rope_layers")
        if flags:
            if not isinstance(flags, list) or len(flags) < n:
                raise ValueError(f"{_ARCH}: no_rope_layers must list at least {n} flags")
            return [bool(f) for f in flags[:n]]
        interval = _int(c, "no_rope_layer_interval", 4)
        return [(i + 1) % interval != 0 for i in range(n)]

    @staticmethod
    def _moe_layers(c: Mapping[str, Any], n: int) -> frozenset[int]:
        layers = c.get("moe_layers")
        if layers is None:
            step = _int(c, "interleave_moe_layer_step", 1)
            return frozenset(range(step - 1, n, step))
        if not isinstance(layers, list) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in layers
        ):
            raise ValueError(f"{_ARCH}: moe_layers must be a list of layer indices")
        return frozenset(layers)

    @staticmethod
    def chunk(spec: AttentionSpec) -> int | None:
        return spec.chunk_size if isinstance(spec, ChunkedLocalSpec) else None


def rope_pairs(
    inv_freq: torch.Tensor, positions: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [T, 1, head_dim // 2], one per adjacent pair of dims."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each pair (2j, 2j+1) rotated as the complex number x_2j + i x_2j+1
    times cos + i sin (in float32, cast back as transformers)."""
    xf = x.float().unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Attention(AttentionProjections):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__(**head_sizes(s), bias=s.attention_bias)
        self.layer_name = f"model.layers.{idx}"
        self.scale = self.head_dim**-0.5
        self.use_rope = s.use_rope[idx]
        self.qk_norm_eps = s.eps if (s.qk_norm and self.use_rope) else None
        self.temperature = (
            (s.floor_scale, s.attn_scale) if (s.temperature_tuning and not self.use_rope) else None
        )
        self.chunk = s.chunk(s.specs[idx])

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project(x)
        if self.use_rope:
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        if self.qk_norm_eps is not None:
            q, k = l2_norm(q, self.qk_norm_eps), l2_norm(k, self.qk_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = batch.positions.to(x.device).float()
            scales = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        out = paged_attention(self.layer_name, q, k, v, batch, scale=self.scale, chunk=self.chunk)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class Experts(nn.Module):
    """The expert matrices as [E, out, in]; gate_up: gate rows, then up rows."""

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        e, h, i = s.num_experts, s.hidden, s.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act = activation(s.act)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return linear(up * self.act(gate), self.down_proj[e])


class MoE(nn.Module):
    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.top_k = s.top_k
        self.router = nn.Linear(s.hidden, s.num_experts, bias=False)
        self.experts = Experts(s)
        self.shared_expert = GatedMLP(s.hidden, s.intermediate, s.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, top_idx = self.router(x).topk(self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)
        # the routed outputs summed in float32 and rounded once, as transformers' sum over
        # the expert dim, then added to the shared expert's
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)

        def contribution(e: int, token, slot) -> torch.Tensor:
            return self.experts(e, x[token] * scores[token, slot, None]).float()

        add_routed(routed, top_idx, contribution)
        return self.shared_expert(x) + routed.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(s, idx)
        if idx in s.moe_layers:
            self.feed_forward: nn.Module = MoE(s)
        else:
            self.feed_forward = GatedMLP(s.hidden, s.intermediate_mlp, s.act)
        self.input_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.feed_forward(self.post_attention_layernorm(x))


def _pair_tables(inv_freq, positions, rope_scale, dtype):
    """`rope_pairs` as the backbone's tables (kept in float32 whatever the model dtype)."""
    return rope_pairs(inv_freq, positions, rope_scale)


class Llama4ForCausalLM(RopeCausalLM):
    arch = _ARCH

    def __init__(self, config: dict) -> None:
        s = _Settings(config)
        super().__init__(
            config,
            s,
            DecoderLayer,
            lambda: RMSNorm(s.hidden, s.eps, scale_after_cast=True),
            _pair_tables,
        )

    def convert(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]):
        if name.startswith(_IGNORED) or name.endswith(_IGNORED_SUFFIXES):
            return ()
        key = next((new + name[len(old) :] for old, new in _PREFIXES if name.startswith(old)), None)
        if key is None:
            raise KeyError(f"{_ARCH}: unexpected weight {name!r}")
        return ((key, _our_layout(name, key, tensor, params.get(key))),)


def _our_layout(name: str, key: str, tensor: torch.Tensor, param) -> torch.Tensor:
    """A checkpoint expert tensor ([E, in, out]) as ours ([E, out, in]); other tensors as they
    are. The checkpoint's shape is checked first, so a transposed tensor cannot slip through."""
    if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return tensor
    check_transposed(_ARCH, name, tensor, param, (0, 2, 1))
    return tensor.transpose(1, 2)
