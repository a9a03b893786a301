"""Jamba (transformers ``JambaForCausalLM``): Mamba1 + attention hybrid with MoE.

Layer i is attention when ``i % attn_layer_period == attn_layer_offset``, Mamba1 otherwise
(the split is read from the layer cache specs of `kvcache.hf_configs`, so the model and the
pool agree); its feed-forward is a top-k MoE when ``i % expert_layer_period ==
expert_layer_offset``, a SwiGLU MLP otherwise. Per layer:

    x += mixer(input_layernorm(x))            mixer: Mamba1 (`mamba1.py`) or attention
    x += feed_forward(pre_ff_layernorm(x))

then ``final_layernorm`` and ``lm_head`` (tied to the embedding with ``tie_word_embeddings``).
Attention has no positional embedding (the Mamba layers carry position), softmax scale
head_dim^-0.5. The MoE router takes the top k of the softmax over all experts and leaves the
selected weights unnormalised. RMS norms apply their weight after the cast back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybrid_pd.engine.models.attention import PagedSelfAttention
from hybrid_pd.engine.models.backbone import MixerOrAttentionLayer, StackCausalLM
from hybrid_pd.engine.models.common import (
    DecoderSettings,
    GatedMLP,
    add_routed,
    config_int,
    load_checkpoint,
)
from hybrid_pd.engine.models.mamba1 import Mamba1Dims, Mamba1Mixer, check_state_spec
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import AttentionSpec, LayerSpec, StateSpec

_ARCH = "Jamba"


def _int(c: Mapping[str, Any], key: str, default: int | None = None, low: int = 1) -> int:
    return config_int(_ARCH, key, c.get(key, default), low)


class _Settings(DecoderSettings):
    """A Jamba config dict, validated, with JambaConfig's defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        c = config.get("text_config") or config
        self.read_decoder(_ARCH, c, vocab=65536, eps=1e-6)
        specs = cache_spec_from_config(dict(config), dtype="float32").layers
        n = _int(c, "num_hidden_layers", 32)
        self.specs: list[LayerSpec] = [specs[f"model.layers.{i}"] for i in range(n)]

        self.num_experts = _int(c, "num_experts", c.get("num_local_experts", 16))
        self.top_k = _int(c, "num_experts_per_tok", 2)
        if self.top_k > self.num_experts:
            raise ValueError(f"{_ARCH}: num_experts_per_tok exceeds num_experts")
        period = _int(c, "expert_layer_period", 2)
        offset = _int(c, "expert_layer_offset", 1, low=0)
        self.moe = [self.num_experts > 1 and i % period == offset for i in range(n)]

        rank = c.get("mamba_dt_rank", "auto")
        dt_rank = math.ceil(self.hidden / 16) if rank in (None, "auto") else int(rank)
        self.mamba = Mamba1Dims(
            hidden=self.hidden,
            inner=_int(c, "mamba_expand", 2) * self.hidden,
            state=_int(c, "mamba_d_state", 16),
            conv_kernel=_int(c, "mamba_d_conv", 4),
            dt_rank=dt_rank,
            eps=self.eps,
            act=self.act,
            conv_bias=bool(c.get("mamba_conv_bias", True)),
            proj_bias=bool(c.get("mamba_proj_bias") or False),
        )


class SparseMoE(nn.Module):
    """Top-k experts of the softmax over all router logits (weights not renormalised).
    Checkpoint names: router.weight [E, hidden], experts.{e}.{gate,up,down}_proj.weight."""

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.top_k = s.top_k
        self.router = nn.Linear(s.hidden, s.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(s.hidden, s.intermediate, s.act) for _ in range(s.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        top_w = top_w.to(x.dtype)

        def contribution(e: int, token, slot) -> torch.Tensor:
            return self.experts[e](x[token]) * top_w[token, slot, None]

        return add_routed(torch.zeros_like(x), top_idx, contribution)


def _layer(s: _Settings, idx: int) -> MixerOrAttentionLayer:
    """Mamba1 or attention, then a SwiGLU MLP or a MoE of them."""

    def mixer(name: str, spec: StateSpec) -> Mamba1Mixer:
        check_state_spec(s.mamba, spec, name, _ARCH)
        return Mamba1Mixer(s.mamba, name)

    def attention(name: str, spec: AttentionSpec) -> PagedSelfAttention:
        return PagedSelfAttention(name, s.hidden, s.num_heads, spec)

    ff = SparseMoE(s) if s.moe[idx] else GatedMLP(s.hidden, s.intermediate, s.act)
    return MixerOrAttentionLayer(s, idx, _ARCH, ff, mixer, attention)


class JambaForCausalLM(StackCausalLM):
    def __init__(self, config: dict) -> None:
        s = _Settings(config)
        super().__init__(s, lambda i: _layer(s, i), len(s.specs))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's tensors in; unknown names, wrong shapes and missing weights
        raise (KeyError / ValueError), naming the tensor. Fused expert tensors (transformers'
        in-memory ``experts.gate_up_proj`` / ``experts.down_proj``) are split per expert."""
        load_checkpoint(self, weights, _ARCH, _unfused)


def _unfused(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(our name, tensor) pairs for one checkpoint tensor."""
    if key.endswith("experts.gate_up_proj"):  # [E, 2I, hidden]: gate rows, then up rows
        base = key[: -len("gate_up_proj")]
        pairs = []
        for e, w in enumerate(tensor):
            gate, up = w.chunk(2, dim=0)
            pairs += [(f"{base}{e}.gate_proj.weight", gate), (f"{base}{e}.up_proj.weight", up)]
        return pairs
    if key.endswith("experts.down_proj"):  # [E, hidden, I]
        base = key[: -len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", w) for e, w in enumerate(tensor)]
    return [(key, tensor)]
