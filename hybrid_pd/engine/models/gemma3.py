"""Gemma 3 text decoder (Gemma3ForCausalLM, and the language model of
Gemma3ForConditionalGeneration) on the paged KV cache.

Per layer: x += post_attn_norm(attn(input_norm(x))); x += post_ffw_norm(mlp(pre_ffw_norm(x))).
All norms are (1 + weight) RMS norms; q_norm / k_norm act per head before RoPE. Layers are
"sliding_attention" (window `sliding_window`: a query sees itself and the window - 1 tokens
before it, as transformers' sliding mask `kv > q - window`) with the local RoPE, or
"full_attention" with the global RoPE (and its scaling). The attention scale is
query_pre_attn_scalar ** -0.5, the embedding is scaled by sqrt(hidden_size) (rounded to the
weight dtype, as transformers does), and `final_logit_softcapping` caps the logits.

`attn_logit_softcapping` is deliberately not applied: transformers' Gemma 3 stores it but never
passes it to its attention functions (eager, sdpa, flash), so applying it would diverge from the
reference. Published Gemma 3 configs set it to null anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import RotaryAttention
from hybrid_pd.engine.models.common import GatedMLP, RMSNorm, copy_weight
from hybrid_pd.engine.onednn import PackedWeights, packed_linear
from hybrid_pd.engine.tp.head import head_logits

SLIDING = "sliding_attention"
FULL = "full_attention"

# Gemma3TextConfig defaults: multimodal text_configs leave many of these out.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}

# Checkpoint prefixes of the language model, longest first.
_PREFIXES = (
    ("model.language_model.", "model."),  # transformers >= 4.52 multimodal
    ("language_model.model.", "model."),  # original Gemma 3 multimodal checkpoints
    ("language_model.lm_head.", "lm_head."),
    ("model.", "model."),
    ("lm_head.", "lm_head."),
)
_IGNORED = ("vision_tower.", "multi_modal_projector.")


class _Settings:
    """The text settings of a Gemma 3 config dict, with transformers' defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        text = config.get("text_config")
        self.text: Mapping[str, Any] = text if isinstance(text, Mapping) else config

    def get(self, key: str) -> Any:
        value = self.text.get(key)
        return _TEXT_DEFAULTS.get(key) if value is None else value

    def layer_types(self) -> list[str]:
        n = int(self.get("num_hidden_layers"))
        kinds = self.text.get("layer_types")
        if kinds is None:
            pattern = int(self.get("sliding_window_pattern"))
            kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        kinds = list(kinds)
        if len(kinds) != n or any(k not in (SLIDING, FULL) for k in kinds):
            raise ValueError(f"gemma3: bad layer_types {kinds!r} for {n} layers")
        return kinds

    def rope(self, kind: str) -> dict[str, Any]:
        """RoPE parameters of one layer type (transformers 5 nested `rope_parameters`, or the
        legacy rope_theta / rope_local_base_freq / rope_scaling fields)."""
        params = self.text.get("rope_parameters") or {}
        nested = params.get(kind) if isinstance(params.get(kind), Mapping) else None
        out: dict[str, Any] = dict(nested or {})
        if kind == FULL and self.text.get("rope_scaling"):
            out.update(self.text["rope_scaling"])  # as transformers: on top of rope_parameters
        if "rope_theta" not in out:
            legacy = "rope_theta" if kind == FULL else "rope_local_base_freq"
            theta = self.text.get(legacy)
            out["rope_theta"] = _DEFAULT_THETA[kind] if theta is None else theta
        # A legacy {"type": ...} without "rope_type" is honoured here; transformers 5.24 keeps
        # "default" in that case (published Gemma 3 configs all write "rope_type").
        out["rope_type"] = out.get("rope_type", out.get("type", "default"))
        return out


def _inv_freq(params: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    theta = float(params["rope_theta"])
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = params["rope_type"]
    if kind == "linear":
        return inv / float(params["factor"])
    if kind != "default":
        raise NotImplementedError(f"gemma3: rope_type {kind!r} is not supported")
    return inv


class Gemma3Attention(RotaryAttention):
    def __init__(self, s: _Settings, layer_idx: int, kind: str) -> None:
        super().__init__(
            layer_idx,
            scale=float(s.get("query_pre_attn_scalar")) ** -0.5,
            window=int(s.get("sliding_window")) if kind == SLIDING else None,
            hidden=int(s.get("hidden_size")),
            num_heads=int(s.get("num_attention_heads")),
            num_kv_heads=int(s.get("num_key_value_heads")),
            head_dim=int(s.get("head_dim")),
            bias=bool(s.get("attention_bias")),
        )
        eps = float(s.get("rms_norm_eps"))
        self.q_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.kind = kind


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, s: _Settings, layer_idx: int, kind: str) -> None:
        super().__init__()
        hidden, eps = int(s.get("hidden_size")), float(s.get("rms_norm_eps"))
        self.kind = kind
        self.self_attn = Gemma3Attention(s, layer_idx, kind)
        act = s.text.get("hidden_activation") or s.text.get("hidden_act") or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(hidden, int(s.get("intermediate_size")), act)
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, batch)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3TextModel(nn.Module):
    def __init__(self, s: _Settings) -> None:
        super().__init__()
        hidden = int(s.get("hidden_size"))
        self.embed_tokens = nn.Embedding(int(s.get("vocab_size")), hidden)
        self.embed_scale = math.sqrt(hidden)
        kinds = s.layer_types()
        self.layers = nn.ModuleList(
            [Gemma3DecoderLayer(s, i, kind) for i, kind in enumerate(kinds)]
        )
        self.norm = RMSNorm(hidden, float(s.get("rms_norm_eps")), offset=1.0)
        head_dim = int(s.get("head_dim"))
        for kind in sorted(set(kinds)):
            inv = _inv_freq(s.rope(kind), head_dim)
            self.register_buffer(f"{kind}_inv_freq", inv, persistent=False)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        s = _Settings(config)
        if s.get("use_bidirectional_attention"):
            raise NotImplementedError("gemma3: use_bidirectional_attention is not supported")
        self.config = config
        self.model = Gemma3TextModel(s)
        tie = config.get("tie_word_embeddings", s.text.get("tie_word_embeddings"))
        self.tie_word_embeddings = True if tie is None else bool(tie)
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(int(s.get("hidden_size")), int(s.get("vocab_size")), False)
        cap = s.get("final_logit_softcapping")
        self.final_softcap = None if cap is None else float(cap)
        self._packs = PackedWeights()

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple]:
        out = {}
        for kind in {layer.kind for layer in self.model.layers}:
            inv = getattr(self.model, f"{kind}_inv_freq").to(positions.device)
            freqs = positions.float()[:, None] * inv[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
            out[kind] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        embed = self.model.embed_tokens
        x = embed(batch.input_ids.to(embed.weight.device))
        x = x * torch.tensor(self.model.embed_scale, dtype=x.dtype, device=x.device)
        rope = self._rope(batch.positions.to(x.device), x.dtype)
        for layer in self.model.layers:
            cos, sin = rope[layer.kind]
            x = layer(x, cos, sin, batch)
        return self.model.norm(x)

    def _tied_head(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight  # through its own packed copy
        return packed_linear(hidden, weight, self._packs.get("lm_head", weight))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding
            weight = self.model.embed_tokens.weight
            logits = head_logits(self, hidden, weight, self._tied_head)
        else:
            logits = head_logits(self, hidden, self.lm_head.weight, self.lm_head)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if any(name.startswith(p) or f".{p}" in name for p in _IGNORED):
                continue
            mapped = next(
                (new + name[len(old) :] for old, new in _PREFIXES if name.startswith(old)), None
            )
            if mapped is None:
                raise KeyError(f"gemma3: unexpected weight {name!r}")
            if mapped == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embedding
            copy_weight(params, mapped, tensor, "gemma3", name)
            loaded.add(mapped)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"gemma3: weights missing from the checkpoint: {missing[:8]}")
