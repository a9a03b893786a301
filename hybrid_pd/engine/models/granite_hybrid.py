"""Granite-4.0-H (transformers ``GraniteMoeHybridForCausalLM``): Mamba2 + attention hybrid.

Each decoder layer is a token mixer (Mamba2 or attention, per ``layer_types``) followed by a
channel mixer (a top-k MoE plus an always-on shared MLP, or the shared MLP alone when
``num_local_experts`` is 0), both pre-normed with RMSNorm and added back to the residual
scaled by ``residual_multiplier``. Embeddings are scaled by ``embedding_multiplier``, attention
uses ``attention_multiplier`` as its softmax scale, logits are divided by ``logits_scaling``,
and attention applies RoPE only when ``position_embedding_type == "rope"``.

Mamba2 per sequence, with the per-layer state [conv_state [conv_dim, K-1], ssm [H, P, N]]:
  in_proj -> (z, xBC, dt); xBC goes through a depthwise causal conv (the conv state supplies
  the K-1 previous inputs) and SiLU and is split into x [H, P], B and C [G, N] (head h uses
  group h // (H / G)); dt = clamp(softplus(dt + dt_bias), time_step_limit); A = -exp(A_log);
  h_t = exp(dt A) h_{t-1} + dt x_t B_t^T, y_t = h_t C_t + D x_t; then y * silu(z) goes through a
  per-group RMSNorm (norm after the gate) and out_proj. Several new tokens use the chunked
  SSD form with chunks of ``mamba_chunk_size`` aligned to absolute positions, so a prefill
  split across steps uses the same chunk boundaries as one pass; one new token uses the
  recurrence. The time-step limit is applied in both forms (transformers' torch decode path
  skips it; the default (0, inf) makes that moot).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch, SeqInfo
from hybrid_pd.engine.models.common import RMSNorm, Rotary, activation, copy_weight
from hybrid_pd.engine.paged import paged_attention, read_state, write_state

_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# transformers' in-memory names -> the checkpoint names our modules use.
_RENAMES = (
    ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
    ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
    ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight"),
)
_SKIP = ("vision_tower", "vision_model", "multi_modal_projector", "audio_tower", "rotary_emb")


def _as_float(value: Any) -> float:
    """A JSON float, also as transformers writes non-finite ones ({"__float__": "Infinity"})."""
    if isinstance(value, dict):
        value = value.get("__float__", value)
    return float(value)


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
        limit = c.get("time_step_limit", (0.0, math.inf))
        self.dt_limit = (0.0, math.inf) if limit is None else tuple(_as_float(v) for v in limit)


# --------------------------------------------------------------------------- Mamba2


def _ssd_chunked(x, dt, a_coef, b, c, chunk: int, h0: torch.Tensor, offset: int):
    """Chunked SSD scan of one sequence (float32).

    x [L, H, P], dt [L, H], a_coef [H] (negative), b/c [L, H, N], h0 [H, P, N]. The first token
    sits at `offset` within its chunk. Returns y [L, H, P] (no D term) and the final state.
    """
    length, heads, hd = x.shape
    tail = (-(offset + length)) % chunk
    nc = (offset + length + tail) // chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # zero rows have dt = 0: no decay and no input, so padding leaves the scan unchanged
        padded = F.pad(t, (0, 0) * (t.dim() - 1) + (offset, tail))
        return padded.reshape(nc, chunk, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # [nc, Q, H, P]
    log_a = chunks(dt * a_coef)  # [nc, Q, H]
    bq, cq = chunks(b), chunks(c)  # [nc, Q, H, N]

    dev = x.device
    # seg[c, l, s, h] = sum of log_a over s < k <= l, built by a masked cumulative sum
    after = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril(-1)  # [k, s]: k > s
    seg = (log_a[:, :, None, :] * after[None, :, :, None]).cumsum(dim=1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril()  # [l, s]
    decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], -math.inf))

    # within a chunk: attention-like mixing with the decay as mask
    weights = torch.einsum("clhn,cshn->clsh", cq, bq) * decay
    y = torch.einsum("clsh,cshp->clhp", weights, xdt)

    # what each chunk adds to the state by its end, starting from zero
    to_end = decay[:, -1]  # [nc, Q(s), H]: decay from s to the chunk's last position
    added = torch.einsum("cshn,csh,cshp->chpn", bq, to_end, xdt)
    whole = torch.exp(log_a.sum(dim=1))  # [nc, H]: decay over a whole chunk

    starts = []
    state = h0
    for i in range(nc):
        starts.append(state)
        state = state * whole[i][:, None, None] + added[i]
    start = torch.stack(starts)  # [nc, H, P, N]

    # contribution of the state each chunk starts from
    from_start = torch.exp(log_a.cumsum(dim=1))  # [nc, Q, H]
    y = y + torch.einsum("clhn,chpn,clh->clhp", cq, start, from_start)
    y = y.reshape(nc * chunk, heads, hd)[offset : offset + length]
    return y, state


def _ssd_step(x, dt, a_coef, b, c, h0):
    """One recurrent step: x [H, P], dt [H], b/c [H, N], h0 [H, P, N] -> y [H, P], state."""
    decay = torch.exp(dt * a_coef)[:, None, None]
    state = h0 * decay + (x * dt[:, None])[:, :, None] * b[:, None, :]
    y = torch.einsum("hpn,hn->hp", state, c)
    return y, state


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z), normalised over groups of `group` channels."""

    def __init__(self, dim: int, group: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group = group
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        g = h.unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(y.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, s: _Settings, name: str) -> None:
        super().__init__()
        self.name = name
        self.heads, self.head_dim = s.m_heads, s.m_head_dim
        self.groups, self.state = s.m_groups, s.m_state
        self.inner = s.m_inner
        self.chunk = s.m_chunk
        self.dt_limit = s.dt_limit
        self.conv_dim = self.inner + 2 * self.groups * self.state
        self.in_proj = nn.Linear(
            s.hidden, self.inner + self.conv_dim + self.heads, bias=s.m_proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, s.m_conv, groups=self.conv_dim, bias=s.m_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, s.eps)
        self.out_proj = nn.Linear(self.inner, s.hidden, bias=s.m_proj_bias)
        self.act = activation(s.act)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        z, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        dt = F.softplus((dt + self.dt_bias).float())
        dt = dt.clamp(min=self.dt_limit[0], max=self.dt_limit[1])
        a_coef = -torch.exp(self.A_log.float())
        y = torch.empty(h.shape[0], self.inner, device=h.device, dtype=torch.float32)
        for seq in batch.seqs:
            sl = slice(seq.start, seq.end)
            y[sl] = self._sequence(batch, seq, xbc[sl], dt[sl], a_coef)
        return self.out_proj(self.norm(y, z).to(h.dtype))

    def _sequence(self, batch, seq: SeqInfo, xbc, dt, a_coef) -> torch.Tensor:
        conv_state, ssm_state = read_state(self.name, batch, seq)
        # depthwise causal conv over [K-1 previous inputs | new inputs]
        window = torch.cat([conv_state.to(xbc.dtype), xbc.t()], dim=1)  # [C, K-1+L]
        new_conv = window[:, window.shape[1] - conv_state.shape[1] :]
        conv = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        xbc = self.act(conv[0].t())  # [L, C]

        length = xbc.shape[0]
        x, b, c = xbc.float().split(
            [self.inner, self.groups * self.state, self.groups * self.state], dim=-1
        )
        x = x.view(length, self.heads, self.head_dim)
        per = self.heads // self.groups
        b = b.view(length, self.groups, self.state).repeat_interleave(per, dim=1)
        c = c.view(length, self.groups, self.state).repeat_interleave(per, dim=1)
        h0 = ssm_state.float()
        if length == 1:
            y, h1 = _ssd_step(x[0], dt[0], a_coef, b[0], c[0], h0)
            y = y[None]
        else:
            offset = seq.num_computed % self.chunk
            y, h1 = _ssd_chunked(x, dt, a_coef, b, c, self.chunk, h0, offset)
        y = y + x * self.D.float()[:, None]
        write_state(self.name, batch, seq, [new_conv.to(conv_state.dtype), h1.to(ssm_state.dtype)])
        return y.reshape(length, self.inner)


# --------------------------------------------------------------------------- attention / MLP


class Attention(nn.Module):
    def __init__(self, s: _Settings, name: str) -> None:
        super().__init__()
        self.name = name
        self.n_heads, self.n_kv, self.head_dim = s.n_heads, s.n_kv, s.head_dim
        self.scale = s.attention_multiplier
        bias = s.attn_bias
        self.q_proj = nn.Linear(s.hidden, s.n_heads * s.head_dim, bias=bias)
        self.k_proj = nn.Linear(s.hidden, s.n_kv * s.head_dim, bias=bias)
        self.v_proj = nn.Linear(s.hidden, s.n_kv * s.head_dim, bias=bias)
        self.o_proj = nn.Linear(s.n_heads * s.head_dim, s.hidden, bias=bias)
        self.rotary = (
            Rotary(s.head_dim, s.rope_theta, scaling_factor=s.rope_factor) if s.rope else None
        )

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = h.shape[0]
        q = self.q_proj(h).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(h).view(t, self.n_kv, self.head_dim)
        v = self.v_proj(h).view(t, self.n_kv, self.head_dim)
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
        return self.output_linear(self.act(gate) * up)


class _Router(nn.Module):
    def __init__(self, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, n_experts, bias=False)


class _ExpertWeights(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class SparseMoE(nn.Module):
    """Top-k experts; the softmax runs over the k selected router logits.

    Checkpoint layout: input_linear.weight [E, 2I, hidden] (gate rows, then up rows),
    output_linear.weight [E, hidden, I], router.layer.weight [E, hidden].
    """

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.n_experts, self.top_k = s.n_experts, s.top_k
        self.router = _Router(s.hidden, s.n_experts)
        self.input_linear = _ExpertWeights((s.n_experts, 2 * s.expert_inter, s.hidden))
        self.output_linear = _ExpertWeights((s.n_experts, s.hidden, s.expert_inter))
        self.act = activation(s.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.layer(x).float()
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for e in top_idx.unique().tolist():
            token, slot = torch.nonzero(top_idx == e, as_tuple=True)
            gate, up = F.linear(x[token], self.input_linear.weight[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.output_linear.weight[e])
            out.index_add_(0, token, y * top_w[token, slot, None])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__()
        name = f"model.layers.{idx}"
        self.residual_multiplier = s.residual_multiplier
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        if s.layer_types[idx] == "linear_attention":
            self.mamba = Mamba2Mixer(s, name)
        else:
            self.self_attn = Attention(s, name)
        self.block_sparse_moe = SparseMoE(s) if s.n_experts > 0 else None
        self.shared_mlp = SharedMLP(s.hidden, s.shared_inter, s.act)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.input_layernorm(h)
        mixer = self.mamba if hasattr(self, "mamba") else self.self_attn
        h = h + mixer(x, batch) * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        y = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(x) + y
        return h + y * self.residual_multiplier


class _Backbone(nn.Module):
    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.n_layers))
        self.norm = RMSNorm(s.hidden, s.eps)


class GraniteMoeHybridForCausalLM(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.settings = s = _Settings(config)
        self.model = _Backbone(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids) * self.settings.embedding_multiplier
        for layer in self.model.layers:
            h = layer(h, batch)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.settings.logits_scaling

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
