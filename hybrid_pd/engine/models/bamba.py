"""Bamba (transformers ``BambaForCausalLM``): Mamba2 + attention hybrid with SwiGLU MLPs.

Layers listed in ``attn_layer_indices`` are attention, all others Mamba2 (the split is read
from the layer cache specs of `kvcache.hf_configs`, so the model and the pool agree). Per layer:

    x += mixer(input_layernorm(x))            mixer: Mamba2 (`mamba2.py`) or attention
    x += feed_forward(pre_ff_layernorm(x))    down(act(gate(x)) * up(x))

then ``final_layernorm`` and ``lm_head`` (tied to the embedding with ``tie_word_embeddings``).
RMS norms apply their weight after the cast back, as transformers' BambaRMSNorm.

Attention: GQA with softmax scale head_dim^-0.5 and RoPE on the first half of each head only:
transformers hard-codes ``partial_rotary_factor`` 0.5 for Bamba (a value inside
``rope_parameters`` wins; a top-level one is overridden). The Mamba2 mixer uses ``hidden_act``
after its conv, scan chunks of at most ``mamba_chunk_size`` tokens and ``time_step_limit``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import PagedSelfAttention
from hybrid_pd.engine.models.backbone import MixerOrAttentionLayer, StackCausalLM
from hybrid_pd.engine.models.common import (
    DecoderSettings,
    GatedMLP,
    config_int,
)
from hybrid_pd.engine.models.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    check_state_spec,
)
from hybrid_pd.engine.models.rope import cos_sin, inverse_frequencies, rope_settings
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import AttentionSpec, LayerSpec, StateSpec

_ARCH = "Bamba"
_PARTIAL_ROTARY = 0.5  # BambaConfig passes this to the RoPE standardisation unconditionally
_IGNORED = ("rotary_emb.",)


def _int(c: Mapping[str, Any], key: str, default: int | None = None) -> int:
    return config_int(_ARCH, key, c.get(key, default))


class _Settings(DecoderSettings):
    """A Bamba config dict, validated, with BambaConfig's defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        c = config.get("text_config") or config
        self.read_decoder(_ARCH, c, vocab=128000, eps=1e-5)
        self.attn_bias = bool(c.get("attention_bias") or False)
        self.mlp_bias = bool(c.get("mlp_bias") or False)
        specs = cache_spec_from_config(dict(config), dtype="float32").layers
        n = _int(c, "num_hidden_layers", 32)
        self.specs: list[LayerSpec] = [specs[f"model.layers.{i}"] for i in range(n)]

        inner = int((c.get("mamba_expand") or 2) * self.hidden)
        self.mamba = Mamba2Dims.from_mamba_keys(
            _ARCH, c, self.hidden, (inner, "mamba_expand * hidden"), self.eps, self.act
        )
        attn = [s for s in self.specs if isinstance(s, AttentionSpec)]
        self.head_dim = attn[0].head_dim if attn else 0
        self._rope_config(c)

    def _rope_config(self, c: Mapping[str, Any]) -> None:
        params = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
        partial = float(params.pop("partial_rotary_factor", _PARTIAL_ROTARY))
        rope_view = {
            "rope_parameters": params,
            "rope_theta": c.get("rope_theta"),
            "max_position_embeddings": c.get("max_position_embeddings"),
            "original_max_position_embeddings": c.get("original_max_position_embeddings"),
        }
        self.rope = rope_settings(rope_view, _ARCH)
        self.rotary_dim = int(self.head_dim * partial)


def _layer(s: _Settings, idx: int) -> MixerOrAttentionLayer:
    """Attention (at ``attn_layer_indices``) or Mamba2, then a gated MLP."""

    def mixer(name: str, spec: StateSpec) -> Mamba2Mixer:
        check_state_spec(s.mamba, spec, name, _ARCH)
        return Mamba2Mixer(s.mamba, name)

    def attention(name: str, spec: AttentionSpec) -> PagedSelfAttention:
        return PagedSelfAttention(
            name, s.hidden, s.num_heads, spec, bias=s.attn_bias, rotary_dim=s.rotary_dim
        )

    mlp = GatedMLP(s.hidden, s.intermediate, s.act, bias=s.mlp_bias)
    return MixerOrAttentionLayer(s, idx, _ARCH, mlp, mixer, attention)


class BambaForCausalLM(StackCausalLM):
    arch, ignored = _ARCH, _IGNORED

    def __init__(self, config: dict) -> None:
        s = _Settings(config)
        super().__init__(s, lambda i: _layer(s, i), len(s.specs))
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.model.inv_freq, self.model.rope_scale = inverse_frequencies(
            s.rope, max(s.rotary_dim, 2)
        )

    def layer_inputs(self, batch: ForwardBatch, x: torch.Tensor) -> tuple:
        rot = None
        if self.settings.rotary_dim:
            positions = batch.positions.to(x.device)
            rot = cos_sin(self.model.inv_freq, positions, self.model.rope_scale, x.dtype)
        return batch, rot
