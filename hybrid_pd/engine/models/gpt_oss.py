"""gpt-oss (transformers ``GptOssForCausalLM``) on the paged KV cache.

Per layer: x += o_proj(attention(input_layernorm(x))); x += moe(post_attention_layernorm(x)),
RMS norms with the weight applied in float32 before the cast back. Attention:

  * q/k/v/o projections with biases, GQA, softmax scale head_dim^-0.5;
  * RoPE from `rope.py` (gpt-oss ships YaRN, factor 32 from 4096 positions, not truncated;
    a config without RoPE fields gets transformers' GptOssConfig default, theta 150000);
  * attention sinks: a learned logit per query head in every softmax denominator, with no
    value (`paged_attention(..., sinks=)`);
  * ``layer_types`` alternates sliding-window and full attention; which layers slide, and
    their window, is read from the layer cache specs (`kvcache.hf_configs`), so attention
    reads exactly what the cache keeps (a query sees itself and the window - 1 before it).

MoE: router logits = x W^T + b; the top k logits are chosen and softmaxed among themselves.
Each expert: gate_up = x W_gu + b_gu, whose columns interleave gate (even) and up (odd);
gate clamped above at ``swiglu_limit``, up to [-limit, limit];
out = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down, weighted by the router.

Checkpoint names are transformers' (what ``save_pretrained`` writes): ``mlp.experts.
gate_up_proj`` [E, hidden, 2I], ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, hidden],
``down_proj_bias`` [E, hidden], ``mlp.router.weight`` / ``bias``, ``self_attn.sinks`` [Hq].
The parameters here keep those names but hold the expert matrices as [E, out, in] (the
layout of `onednn.linear`), gate_up with the gate rows first and the up rows after (the
interleaving undone once, at load). MXFP4-quantized checkpoints (``*_blocks`` /
``*_scales``, as openai publishes) are refused: dequantize them to bfloat16 first.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import RotaryAttention, head_sizes, sliding_window
from hybrid_pd.engine.models.backbone import RopeCausalLM, attention_geometry, routed_experts
from hybrid_pd.engine.models.common import (
    RMSNorm,
    add_routed,
    check_transposed,
    config_int,
)
from hybrid_pd.engine.models.rope import cos_sin, rope_settings
from hybrid_pd.engine.onednn import linear
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import AttentionSpec

_ARCH = "gpt-oss"
# GptOssConfig's RoPE when a config names none (transformers 5.24).
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_DEFAULT_THETA = 150_000.0
_QUANTIZED_SUFFIXES = ("_blocks", "_scales")


def _int(c: Mapping[str, Any], key: str, default: int | None = None) -> int:
    return config_int(_ARCH, key, c.get(key, default))


class _Settings:
    """A gpt-oss config dict, validated, with GptOssConfig's defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        c = dict(config.get("text_config") or config)
        self.vocab = _int(c, "vocab_size", 201088)
        self.hidden = _int(c, "hidden_size", 2880)
        self.intermediate = _int(c, "intermediate_size", 2880)
        self.num_heads = _int(c, "num_attention_heads", 64)
        self.num_experts, self.top_k = routed_experts(_ARCH, partial(_int, c), 128, 4)
        self.eps = float(c.get("rms_norm_eps") or 1e-5)
        self.alpha = float(c.get("swiglu_alpha") or 1.702)
        self.limit = float(c.get("swiglu_limit") or 7.0)
        self.tie = bool(c.get("tie_word_embeddings") or False)
        self.attention_bias = bool(c.get("attention_bias", True))
        if not (c.get("rope_scaling") or c.get("rope_parameters")):
            c["rope_parameters"] = dict(_DEFAULT_ROPE)
        if c.get("rope_theta") is None and "rope_theta" not in (
            c.get("rope_scaling") or c.get("rope_parameters")
        ):
            c["rope_theta"] = _DEFAULT_THETA
        self.rope = rope_settings(c, _ARCH)
        specs = cache_spec_from_config(dict(config), dtype="float32").layers
        n = _int(c, "num_hidden_layers", 36)
        self.specs: list[AttentionSpec] = [specs[f"model.layers.{i}"] for i in range(n)]
        self.head_dim, self.num_kv_heads = attention_geometry(_ARCH, self.specs)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{_ARCH}: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )


class Attention(RotaryAttention):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__(
            idx,
            scale=s.head_dim**-0.5,
            window=sliding_window(s.specs[idx]),
            **head_sizes(s),
            bias=s.attention_bias,
        )
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))


class Experts(nn.Module):
    """The expert matrices as [E, out, in]; gate_up: gate rows, then up rows."""

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        e, h, i = s.num_experts, s.hidden, s.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = s.alpha, s.limit

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj[e], self.gate_up_proj_bias[e]).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return linear(h, self.down_proj[e], self.down_proj_bias[e])


class MoE(nn.Module):
    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.top_k = s.top_k
        self.router = nn.Linear(s.hidden, s.num_experts, bias=True)
        self.experts = Experts(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, top_idx = self.router(x).topk(self.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1)

        def contribution(e: int, token, slot) -> torch.Tensor:
            return self.experts(e, x[token]) * top_w[token, slot, None]

        return add_routed(torch.zeros_like(x), top_idx, contribution)


class DecoderLayer(nn.Module):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(s, idx)
        self.mlp = MoE(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(RopeCausalLM):
    arch = _ARCH

    def __init__(self, config: dict) -> None:
        s = _Settings(config)
        super().__init__(config, s, DecoderLayer, lambda: RMSNorm(s.hidden, s.eps), cos_sin)

    def convert(self, key: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]):
        if key.endswith(_QUANTIZED_SUFFIXES):
            raise NotImplementedError(
                f"{_ARCH}: {key!r} is MXFP4-quantized; the engine needs a checkpoint "
                "with plain (bfloat16 / float32) expert weights"
            )
        return ((key, _our_layout(key, tensor, params.get(key))),)


def _our_layout(key: str, tensor: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """A checkpoint expert tensor in our layout (other tensors unchanged). The checkpoint's
    shape is checked first, so a transposed tensor cannot slip through."""
    if key.endswith("experts.gate_up_proj"):  # [E, hidden, 2I], gate / up interleaved
        check_transposed(_ARCH, key, tensor, param, (0, 2, 1))
        w = tensor.transpose(1, 2)
        return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    if key.endswith("experts.gate_up_proj_bias"):  # [E, 2I], interleaved
        return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
    if key.endswith("experts.down_proj"):  # [E, I, hidden]
        check_transposed(_ARCH, key, tensor, param, (0, 2, 1))
        return tensor.transpose(1, 2)
    return tensor
