"""Granite-4.0-H (transformers ``GraniteMoeHybridForCausalLM``): Mamba2 + attention hybrid.

Each decoder layer is a token mixer (Mamba2 or attention, per ``layer_types``) followed by a
channel mixer (a top-k MoE plus an always-on shared MLP, or the shared MLP alone when
``num_local_experts`` is 0), both pre-normed with RMSNorm and added back to the residual
scaled by ``residual_multiplier``. Embeddings are scaled by ``embedding_multiplier``, attention
uses ``attention_multiplier`` as its softmax scale, logits are divided by ``logits_scaling``,
and attention applies RoPE only when ``position_embedding_type == "rope"``.

The Mamba2 mixer is `mamba2.Mamba2Mixer` (shared with Bamba and Nemotron-H), with scan chunks
of at most ``mamba_chunk_size`` tokens and ``time_step_limit`` applied in both the chunked and
the recurrent form.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import AttentionProjections
from hybrid_pd.engine.models.common import (
    BackboneLM,
    RMSNorm,
    Rotary,
    act_times,
    activation,
    add_routed,
    copy_weight,
)
from hybrid_pd.engine.models.mamba2 import Mamba2Dims, Mamba2Mixer, time_step_limit
from hybrid_pd.engine.onednn import PackedWeights, packed_linear, run_packed
from hybrid_pd.engine.paged_attention import paged_attention
from hybrid_pd.engine.tp.head import head_logits

_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# transformers' in-memory names -> the checkpoint names our modules use.
_RENAMES = (
    ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
    ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
    ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"),
)
_SKIP = ("vision_tower", "vision_model", "multi_modal_projector", "audio_tower", "rotary_emb")


class _Settings:
    """The text settings of a GraniteMoeHybrid config dict, with transformers' defaults."""

    def __init__(self, config: dict) -> None:
        c = config.get("text_config") or config
        self.vocab = c["vocab_size"]
        self.hidden = c["hidden_size"]
        self.n_layers = c["num_hidden_layers"]
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.act = c.get("hidden_act", "silu")
        self.tie = bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False)))
        self.embedding_multiplier = float(c.get("embedding_multiplier") or 1.0)
        self.residual_multiplier = float(c.get("residual_multiplier") or 1.0)
        self.attention_multiplier = float(c.get("attention_multiplier") or 1.0)
        self.logits_scaling = float(c.get("logits_scaling") or 1.0)
        kinds = c.get("layer_types") or c.get("layers_block_type")
        kinds = kinds or ["linear_attention"] * self.n_layers
        self.layer_types = [_LEGACY_TYPES.get(k, k) for k in kinds]
        if len(self.layer_types) != self.n_layers:
            raise ValueError("layer_types must have one entry per layer")
        for kind in self.layer_types:
            if kind not in ("linear_attention", "full_attention"):
                raise ValueError(f"GraniteMoeHybrid: unknown layer type {kind!r}")
        # attention
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or self.hidden // self.n_heads
        self.attn_bias = bool(c.get("attention_bias", False))
        self.rope = c.get("position_embedding_type") == "rope"
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        self.rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if self.rope and rope_type not in ("default", "linear"):
            raise NotImplementedError(f"GraniteMoeHybrid: rope_type {rope_type!r}")
        self.rope_factor = float(rope.get("factor", 1.0)) if rope_type == "linear" else 1.0
        # MLP / MoE
        self.n_experts = int(c.get("num_local_experts") or 0)
        self.top_k = int(c.get("num_experts_per_tok") or 0)
        self.expert_inter = c.get("intermediate_size")
        self.shared_inter = c.get("shared_intermediate_size", 1024)
        # Mamba2
        self.m_heads = c.get("mamba_n_heads", 128)
        self.m_groups = c.get("mamba_n_groups", 1)
        self.m_state = c.get("mamba_d_state", 256)
        self.m_conv = c.get("mamba_d_conv", 4)
        self.m_inner = int((c.get("mamba_expand") or 2) * self.hidden)
        d_head = c.get("mamba_d_head", "auto")
        self.m_head_dim = self.m_inner // self.m_heads if d_head in (None, "auto") else d_head
        if self.m_head_dim * self.m_heads != self.m_inner:
            raise ValueError("mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
        self.m_chunk = c.get("mamba_chunk_size", 256)
        self.m_conv_bias = c.get("mamba_conv_bias", True)
        self.m_proj_bias = bool(c.get("mamba_proj_bias", False))
        self.dt_limit = time_step_limit(c.get("time_step_limit", (0.0, math.inf)))

    def mamba2(self) -> Mamba2Dims:
        return Mamba2Dims(
            hidden=self.hidden,
            heads=self.m_heads,
            head_dim=self.m_head_dim,
            groups=self.m_groups,
            state=self.m_state,
            conv_kernel=self.m_conv,
            chunk=self.m_chunk,
            eps=self.eps,
            act=self.act,
            conv_bias=self.m_conv_bias,
            proj_bias=self.m_proj_bias,
            dt_limit=self.dt_limit,
        )


# --------------------------------------------------------------------------- attention / MLP


class Attention(AttentionProjections):
    def __init__(self, s: _Settings, name: str) -> None:
        super().__init__(s.hidden, s.n_heads, s.n_kv, s.head_dim, bias=s.attn_bias)
        self.name = name
        self.scale = s.attention_multiplier
        self.rotary = (
            Rotary(s.head_dim, s.rope_theta, scaling_factor=s.rope_factor) if s.rope else None
        )

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.project(h)
        if self.rotary is not None:
            q = self.rotary(q, batch.positions)
            k = self.rotary(k, batch.positions)
        out = paged_attention(self.name, q, k, v, batch, scale=self.scale)
        return self.o_proj(out.reshape(t, -1))


class SharedMLP(nn.Module):
    """output_linear(act(first half) * second half of input_linear(x))."""

    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(act_times(self.act, gate, up))


class _Router(nn.Module):
    def __init__(self, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, n_experts, bias=False)


class _ExpertWeights(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


#: Most tokens a MoE layer runs through all its experts at once (`SparseMoE._all_experts`):
#: up to here a CPU step reads the expert weights, it hardly computes on them.
ALL_EXPERTS_MAX_TOKENS = 32
#: Largest expert weights (bytes, one layer) that take the all-experts path. It saves two
#: calls per expert, which matter where experts are small; its packed copy of the experts
#: costs this much memory again.
ALL_EXPERTS_MAX_BYTES = 32 * 2**20


class SparseMoE(nn.Module):
    """Top-k experts; the softmax runs over the k selected router logits.

    Checkpoint layout: input_linear.weight [E, 2I, hidden] (gate rows, then up rows),
    output_linear.weight [E, hidden, I], router.layer.weight [E, hidden].

    A few tokens that between them pick every expert (a decode batch) of a layer with small
    experts go through all the experts as two GEMMs (`_all_experts`); other batches route
    each token to its experts (`add_routed`, two GEMMs per expert).
    """

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.n_experts, self.top_k = s.n_experts, s.top_k
        self.router = _Router(s.hidden, s.n_experts)
        self.input_linear = _ExpertWeights((s.n_experts, 2 * s.expert_inter, s.hidden))
        self.output_linear = _ExpertWeights((s.n_experts, s.hidden, s.expert_inter))
        self.act = activation(s.act)
        self._packs = PackedWeights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.layer(x).float()
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1).to(x.dtype)
        if self._all_experts_pay(x, top_idx):
            w_in, w_out = self._stacked_packs(x)
            if w_in is not None and w_out is not None:
                return self._all_experts(x, top_idx, top_w, w_in, w_out)

        def contribution(e: int, tokens, slots) -> torch.Tensor:
            return self._expert(e, x[tokens]) * top_w[tokens, slots, None]

        return add_routed(torch.zeros_like(x), top_idx, contribution)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w_in, w_out = self.input_linear.weight[e], self.output_linear.weight[e]
        gate, up = packed_linear(x, w_in, self._packs.get(("in", e), w_in)).chunk(2, dim=-1)
        a = act_times(self.act, gate, up)
        return packed_linear(a, w_out, self._packs.get(("out", e), w_out))

    def _all_experts_pay(self, x: torch.Tensor, top_idx: torch.Tensor) -> bool:
        """Every expert picked (routing reads every expert's weights anyway), few tokens
        (reading them, not computing, is the cost), small experts (two calls per expert
        weigh against their reads)."""
        t, e = top_idx.shape[0], self.n_experts
        if not 1 < t <= ALL_EXPERTS_MAX_TOKENS or t * self.top_k < e:
            return False
        weights = self.input_linear.weight.numel() + self.output_linear.weight.numel()
        if weights * x.element_size() > ALL_EXPERTS_MAX_BYTES:
            return False
        return int(torch.unique(top_idx).numel()) == e

    def _all_experts(self, x, top_idx, top_w, w_in, w_out) -> torch.Tensor:
        """Every expert on every token, weighted by the routing (0 where a token did not pick
        the expert): one GEMM over the experts' input matrices side by side, one over their
        output matrices end to end, the routing weights applied in between. The weight bytes
        of routing, two calls instead of two per expert (8 tokens, 4 experts of 512 x 256:
        0.6 against 0.97 ms); the sums run in another order (float rounding apart)."""
        t, e = x.shape[0], self.n_experts
        weights = x.new_zeros(t, e).scatter_(1, top_idx, top_w)  # [T, E]
        gate, up = run_packed(x, w_in, None).view(t, e, -1).chunk(2, dim=-1)
        a = (self.act(gate) * up).mul_(weights[..., None]).view(t, -1)  # [T, E * I]
        return run_packed(a, w_out, None)

    def _stacked_packs(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`pack_weight` copies of input_linear as [E * 2I, hidden] and output_linear as
        [hidden, E * I] (built on first use, rebuilt when a weight changes); None where
        no pack takes x."""
        w_in, w_out = self.input_linear.weight, self.output_linear.weight
        if x.dtype is not w_in.dtype:
            return None, None
        packed_in = self._packs.get("all_in", w_in, lambda w: w.reshape(-1, w.shape[-1]))
        packed_out = self._packs.get(
            "all_out", w_out, lambda w: w.permute(1, 0, 2).reshape(w.shape[1], -1)
        )
        return packed_in, packed_out


class DecoderLayer(nn.Module):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__()
        name = f"model.layers.{idx}"
        self.residual_multiplier = s.residual_multiplier
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        if s.layer_types[idx] == "linear_attention":
            self.mamba = Mamba2Mixer(s.mamba2(), name)
        else:
            self.self_attn = Attention(s, name)
        self.block_sparse_moe = SparseMoE(s) if s.n_experts > 0 else None
        self.shared_mlp = SharedMLP(s.hidden, s.shared_inter, s.act)
        # The feed-forward sum (shared MLP + MoE): with tensor parallelism each rank holds a
        # partial sum of it, all-reduced here once (a hook) rather than once per branch.
        self.feed_forward_sum = nn.Identity()

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.input_layernorm(h)
        mixer = self.mamba if hasattr(self, "mamba") else self.self_attn
        h = h + mixer(x, batch) * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        y = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(x) + y
        return h + self.feed_forward_sum(y) * self.residual_multiplier


class _Backbone(nn.Module):
    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.n_layers))
        self.norm = RMSNorm(s.hidden, s.eps)


class GraniteMoeHybridForCausalLM(BackboneLM):
    def __init__(self, config: dict) -> None:
        super().__init__(_Settings(config), _Backbone)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids) * self.settings.embedding_multiplier
        for layer in self.model.layers:
            h = layer(h, batch)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = head_logits(self, hidden, self.lm_head.weight, self.lm_head)
        return logits / self.settings.logits_scaling

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = _our_name(raw)
            if name is None:
                continue
            copy_weight(params, name, tensor, "GraniteMoeHybrid", raw)
            loaded.add(name)
        if "lm_head.weight" not in loaded and self.settings.tie:
            self.lm_head.weight.copy_(self.model.embed_tokens.weight)
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"GraniteMoeHybrid: weights missing from the checkpoint: {missing}")


def _our_name(raw: str) -> str | None:
    """Checkpoint name -> our parameter name; None for tensors we do not use."""
    if any(part in raw for part in _SKIP):
        return None
    name = raw
    if name.endswith("lm_head.weight"):
        return "lm_head.weight"
    if not name.startswith("lm_head."):
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix) :]
                break
    for old, new in _RENAMES:
        if name.endswith(old):
            name = name[: -len(old)] + new
    return name
