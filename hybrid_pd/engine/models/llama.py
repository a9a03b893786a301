"""Dense decoders of the Llama family on the paged KV cache: LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

Per layer: x += o_proj(attention(input_layernorm(x))); x += mlp(post_attention_layernorm(x)),
with plain RMS norms (weight applied after the cast back, as transformers), GQA, RoPE
(`rope.py`: default, linear, llama3, yarn) and a SwiGLU MLP. The families differ in:

  family   q/k/v bias        o bias            MLP bias   per-head q/k norm
  Llama    attention_bias    attention_bias    mlp_bias   -
  Mistral  -                 -                 -          -
  Qwen2    always            -                 -          -
  Qwen3    attention_bias    attention_bias    -          before RoPE

Which layers are sliding-window attention, and their window, is read from the layer's cache
spec (`kvcache.hf_configs`), so attention reads exactly what the KV cache keeps: Mistral
slides on every layer when `sliding_window` is set, Qwen2/Qwen3 from `max_window_layers` on
when `use_sliding_window` is true (or as `layer_types` says). A query sees itself and the
window - 1 tokens before it, as transformers' sliding mask. The head dim comes from the same
spec: `head_dim` when given, else hidden_size / num_attention_heads (Qwen3 requires it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import RotaryAttention, head_sizes, sliding_window
from hybrid_pd.engine.models.backbone import RopeBackbone
from hybrid_pd.engine.models.common import GatedMLP, RMSNorm, load_checkpoint
from hybrid_pd.engine.models.rope import cos_sin, rope_settings
from hybrid_pd.engine.onednn import PackedWeights, packed_linear
from hybrid_pd.engine.tp.head import head_logits
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import AttentionSpec

# Buffers that old checkpoints saved with the weights; recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Family:
    """What one architecture adds to the common decoder. A bias flag is either fixed or
    the name of the config field that sets it."""

    name: str
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool = False


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", "attention_bias", "attention_bias", "mlp_bias"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", "attention_bias", "attention_bias", qk_norm=True),
}


class _Settings:
    """Validated sizes of one config dict, with the family's switches resolved."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in FAMILIES:
            raise ValueError(f"dense decoder: unsupported architecture {arch!r}")
        self.family = FAMILIES[arch]
        self.config = config
        name = self.family.name
        self.hidden = self._size("hidden_size")
        self.intermediate = self._size("intermediate_size")
        self.vocab = self._size("vocab_size")
        self.num_heads = self._size("num_attention_heads")
        self.eps = float(config.get("rms_norm_eps") or 1e-6)
        self.act = config.get("hidden_act") or "silu"
        self.tie = bool(config.get("tie_word_embeddings") or False)
        self.rope = rope_settings(config, name)
        specs = cache_spec_from_config(config, dtype="float32").layers
        self.layers: list[AttentionSpec] = [specs[f"model.layers.{i}"] for i in range(len(specs))]
        head_dims = {s.head_dim for s in self.layers}
        if len(head_dims) != 1:
            raise ValueError(f"{name}: layers disagree on head_dim: {sorted(head_dims)}")
        self.head_dim = head_dims.pop()
        self.num_kv_heads = self.layers[0].num_kv_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{name}: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    def _size(self, key: str) -> int:
        value = self.config.get(key)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{self.family.name}: config field {key!r} must be a positive integer, "
                f"got {value!r}"
            )
        return value

    def flag(self, switch: bool | str) -> bool:
        return switch if isinstance(switch, bool) else bool(self.config.get(switch) or False)


class Attention(RotaryAttention):
    def __init__(self, s: _Settings, layer_idx: int) -> None:
        super().__init__(
            layer_idx,
            scale=s.head_dim**-0.5,
            window=sliding_window(s.layers[layer_idx]),
            **head_sizes(s),
            bias=s.flag(s.family.qkv_bias),
            o_bias=s.flag(s.family.o_bias),
        )
        if s.family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, s.eps, scale_after_cast=True)
            self.k_norm = RMSNorm(self.head_dim, s.eps, scale_after_cast=True)


class DecoderLayer(nn.Module):
    def __init__(self, s: _Settings, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(s, layer_idx)
        self.mlp = GatedMLP(s.hidden, s.intermediate, s.act, bias=s.flag(s.family.mlp_bias))
        self.input_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseForCausalLM(nn.Module):
    """Any of the four architectures in `FAMILIES` (picked by ``architectures[0]``)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        s = _Settings(config)
        self.config = config
        self.family = s.family
        self.model = RopeBackbone(
            s.vocab,
            s.hidden,
            len(s.layers),
            lambda i: DecoderLayer(s, i),
            lambda: RMSNorm(s.hidden, s.eps, scale_after_cast=True),
            s.rope,
            s.head_dim,
        )
        self.lm_head = None if s.tie else nn.Linear(s.hidden, s.vocab, bias=False)
        self._packs = PackedWeights()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.run(batch, cos_sin)

    def _tied_head(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight  # through its own packed copy
        return packed_linear(hidden, weight, self._packs.get("lm_head", weight))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding
            weight = self.model.embed_tokens.weight
            return head_logits(self, hidden, weight, self._tied_head)
        return head_logits(self, hidden, self.lm_head.weight, self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's tensors in; unknown names, wrong shapes and missing
        weights raise (KeyError / ValueError), naming the tensor."""

        def convert(key: str, tensor: torch.Tensor):
            return () if key.endswith(_IGNORED_SUFFIXES) else ((key, tensor),)

        load_checkpoint(self, weights, self.family.name, convert)
