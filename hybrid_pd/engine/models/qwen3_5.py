"""Qwen3.5 and Qwen3-Next: Gated DeltaNet layers mixed with gated full attention.

Layer kinds come from ``layer_types`` (else a full-attention layer every
``full_attention_interval`` layers, default 4):

* ``linear_attention`` -- Gated DeltaNet. ``in_proj_qkv`` feeds a depthwise causal conv1d
  (kernel K, SiLU) whose state is the last K - 1 inputs; q/k are L2-normalised, q scaled by
  1/sqrt(d_k); per head a decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and a write
  strength ``beta = sigmoid(b)`` drive the gated delta rule on a [d_k, d_v] state:
  ``S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q``. The output goes through an
  RMS norm gated by ``silu(in_proj_z(x))`` and ``out_proj``.
* ``full_attention`` -- ``q_proj`` yields query and an output gate per head, RMS norms on q and
  k per head, rotary embedding on the first ``partial_rotary_factor`` of each head, output
  multiplied by ``sigmoid(gate)`` before ``o_proj``.

Norms other than the gated one use the (1 + weight) form. The text-only position ids of the
multimodal rotary (mrope) are equal on its three axes, so it reduces to plain rotary here.

The two families share every formula; a `Family` row holds what differs:

  family      GDN input projections              MoE layers                   top-k renorm
  Qwen3.5     in_proj_qkv, _z, _b, _a            all (when num_experts)       always
  Qwen3-Next  in_proj_qkvz, in_proj_ba, fused    decoder_sparse_step and      norm_topk_prob
              and grouped per key head           mlp_only_layers pick them

Qwen3-Next's fused rows come per key head h: [q_h (dk), k_h (dk), v (r x dv), z (r x dv)]
and [b (r), a (r)], r = value heads per key head (value heads h*r .. h*r + r - 1); split,
they are Qwen3.5's q / k / v / z / b / a. Dense layers of a Qwen3-Next MoE model use
``intermediate_size``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import AttentionProjections
from hybrid_pd.engine.models.common import (
    GatedMLP,
    RMSNorm,
    Rotary,
    activation,
    add_routed,
)
from hybrid_pd.engine.models.gated_deltanet import GatedDeltaNet
from hybrid_pd.engine.onednn import linear
from hybrid_pd.engine.paged_attention import paged_attention
from hybrid_pd.engine.tp.head import head_logits

__all__ = [
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "tiny_qwen3_5_config",
]

_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


@dataclass(frozen=True)
class Family:
    """What differs between Qwen3.5 and Qwen3-Next (see the module docstring)."""

    name: str
    fused_gdn_proj: bool = False  # in_proj_qkvz / in_proj_ba, grouped per key head
    sparse_step: bool = False  # decoder_sparse_step / mlp_only_layers choose the MoE layers
    norm_topk_key: bool = False  # norm_topk_prob from the config, else always renormalise


QWEN3_5 = Family("Qwen3.5")
QWEN3_NEXT = Family("Qwen3-Next", fused_gdn_proj=True, sparse_step=True, norm_topk_key=True)


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return dict(text) if isinstance(text, Mapping) else dict(config)


def _moe_layers(cfg: Mapping[str, Any], family: Family) -> list[bool]:
    """Which layers have the sparse MoE block (the others a dense MLP)."""
    n = int(cfg["num_hidden_layers"])
    if not cfg.get("num_experts"):
        return [False] * n
    if not family.sparse_step:
        return [True] * n
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def _layer_types(cfg: Mapping[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        every = int(cfg.get("full_attention_interval") or 4)
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    kinds = list(kinds)[:n]
    for kind in kinds:
        if kind not in ("full_attention", "linear_attention"):
            raise ValueError(f"Qwen3.5 / Qwen3-Next: unknown layer type {kind!r}")
    return kinds


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from ``rope_parameters`` or the legacy top-level keys."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"Qwen3.5 / Qwen3-Next: rope_type {kind!r} is not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


# --------------------------------------------------------------------------- delta rule


class GatedAttention(AttentionProjections):
    def __init__(self, cfg: Mapping[str, Any], layer_name: str) -> None:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        super().__init__(
            hidden,
            heads,
            int(cfg.get("num_key_value_heads") or heads),
            int(cfg.get("head_dim") or hidden // heads),
            bias=bool(cfg.get("attention_bias", False)),
            q_per_head=2,
        )
        self.layer_name = layer_name
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        theta, factor = _rope(cfg)
        self.rotary = Rotary(self.head_dim, theta, rotary_dim=int(self.head_dim * factor))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self._qkv(x)
        qg = qg.view(t, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = self.rotary(self.q_norm(q), batch.positions)
        k = self.rotary(self.k_norm(k), batch.positions)
        o = paged_attention(self.layer_name, q, k, v, batch, scale=self.head_dim**-0.5)
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class SparseMoE(nn.Module):
    """Qwen3.5-MoE / Qwen3-Next MLP: softmax router, top-k experts (weights renormalised to
    sum to 1 unless `norm_topk` is off) plus
    a shared expert scaled by sigmoid(shared_expert_gate(x)). Expert weights are stacked:
    gate_proj / up_proj [E, I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: Mapping[str, Any], norm_topk: bool = True) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.norm_topk = norm_topk
        self.num_experts = int(cfg["num_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        inter = int(cfg["moe_intermediate_size"])
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.gate_proj = nn.Parameter(torch.empty(self.num_experts, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        act = cfg.get("hidden_act", "silu")
        self.act = activation(act)
        self.shared_expert = GatedMLP(hidden, int(cfg["shared_expert_intermediate_size"]), act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(logits.dtype)

        def contribution(e: int, tok, slot) -> torch.Tensor:
            h = x[tok]
            h = self.act(linear(h, self.gate_proj[e])) * linear(h, self.up_proj[e])
            return (linear(h, self.down_proj[e]) * weights[tok, slot, None]).to(x.dtype)

        out = add_routed(torch.zeros_like(x), experts, contribution)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: Mapping[str, Any], index: int, kind: str, moe: bool, family: Family
    ) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        name = f"model.layers.{index}"
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, name, fused=family.fused_gdn_proj)
        else:
            self.self_attn = GatedAttention(cfg, name)
        if moe:
            norm_topk = bool(cfg.get("norm_topk_prob", True)) if family.norm_topk_key else True
            self.mlp: nn.Module = SparseMoE(cfg, norm_topk)
        else:
            act = cfg.get("hidden_act", "silu")
            self.mlp = GatedMLP(hidden, int(cfg["intermediate_size"]), act)
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        x = x + mixer(h, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], family: Family = QWEN3_5) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), hidden)
        kinds, moe = _layer_types(cfg), _moe_layers(cfg, family)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, kind, moe[i], family) for i, kind in enumerate(kinds)
        )
        self.norm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)), offset=1.0)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm(x)


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 text model: ``Qwen3_5ForCausalLM`` / ``Qwen3_5ForConditionalGeneration``, and
    the MoE variant (``num_experts`` in the config) of ``Qwen3_5Moe*``."""

    family = QWEN3_5

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = _text_config(config)
        self.config = cfg
        tie = config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        self.tie_word_embeddings = bool(tie)
        self.model = Qwen3_5Model(cfg, self.family)
        self.lm_head = nn.Linear(int(cfg["hidden_size"]), int(cfg["vocab_size"]), bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self, hidden, self.lm_head.weight, self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names, text-only or multimodal layout; MoE experts either one tensor
        per expert (``mlp.experts.{e}.gate_proj.weight``) or stacked (``gate_up_proj``)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model.") :]
            elif name.startswith("language_model."):
                name = "model." + name[len("language_model.") :]
            if name.startswith(_IGNORED_PREFIXES):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            for target, expert, part in _split_checkpoint_tensor(name, tensor):
                if target not in params:
                    raise KeyError(f"{self.family.name}: unexpected weight {name!r}")
                dest = params[target] if expert is None else params[target][expert]
                if tuple(dest.shape) != tuple(part.shape):
                    raise ValueError(
                        f"{self.family.name}: weight {name!r} has shape {tuple(part.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                dest.copy_(part.to(dest.dtype))
                if expert is not None:
                    loaded.add(f"{target}#{expert}")
                elif isinstance(self.get_submodule(target.rsplit(".", 1)[0]), SparseMoE):
                    loaded.update(f"{target}#{e}" for e in range(part.shape[0]))
                else:
                    loaded.add(target)
        expected = set()
        for pname, param in params.items():
            if self.tie_word_embeddings and pname == "lm_head.weight":
                continue
            if isinstance(self.get_submodule(pname.rsplit(".", 1)[0]), SparseMoE):
                expected.update(f"{pname}#{e}" for e in range(param.shape[0]))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise KeyError(f"{self.family.name}: checkpoint is missing weights {missing[:8]}")


_EXPERT = re.compile(r"(.+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"(.+\.mlp)\.experts\.(gate_up_proj|down_proj)")


def _split_checkpoint_tensor(name: str, tensor: torch.Tensor):
    """(our parameter, expert index or None, tensor) pieces of one checkpoint tensor."""
    if m := _EXPERT.fullmatch(name):
        return [(f"{m[1]}.{m[3]}", int(m[2]), tensor)]
    if m := _STACKED.fullmatch(name):
        if m[2] == "down_proj":
            return [(f"{m[1]}.down_proj", None, tensor)]
        gate, up = tensor.chunk(2, dim=1)  # [E, 2I, H]: gate rows first
        return [(f"{m[1]}.gate_proj", None, gate), (f"{m[1]}.up_proj", None, up)]
    return [(name, None, tensor)]


Qwen3_5MoeForCausalLM = Qwen3_5ForCausalLM  # same class; the config decides dense or MoE


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next (``Qwen3NextForCausalLM``): the Qwen3.5 model with the QWEN3_NEXT switches."""

    family = QWEN3_NEXT


def tiny_qwen3_5_config() -> dict[str, Any]:
    """A small Qwen3.5 ``config.json`` (6 layers: GDN, GDN, attention, twice) with a 512-entry
    vocabulary: 256 byte tokens, then specials (256 = bos, 257 = eos, 258 = pad)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "dtype": "float32",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 6,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attention_bias": False,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
    }
