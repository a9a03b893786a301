"""Nemotron-H (transformers ``NemotronHForCausalLM``): blocks of one mixer each.

The layer pattern comes from ``layers_block_type`` / ``layer_types`` (a list) or the older
``hybrid_override_pattern`` string, one symbol per block:

    M  Mamba2 mixer (`mamba2.py`)                      state page
    *  attention: no position encoding, no biases      paged KV
    -  MLP: down(relu2(up(x)))                         no cache
    E  MoE: routed experts + one shared expert MLP     no cache

MoE (Nemotron 3): sigmoid router scores; experts picked by score + ``e_score_correction_bias``
within the ``topk_group`` best of ``n_group`` expert groups; weights are the picked unbiased
scores, normalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``; experts are
down(relu2(up(x))) around an optional ``moe_latent_size`` projection. The router runs in
float32 on whatever dtype its weight has: transformers keeps that weight in float32 even in a
bfloat16 model, our loader casts it with the rest (a difference in bfloat16 only).

Every block is x += mixer(norm(x)) with a single RMS norm (weight multiplied in float32 before
the cast back); then ``norm_f`` and an untied ``lm_head`` (transformers ties nothing for this
family), logits in float32. Which blocks own which cache is checked against the layer specs
of `kvcache.hf_configs`.

Mamba2 details that differ from Granite / Bamba: the inner size is mamba_num_heads *
mamba_head_dim (not expand * hidden); in_proj / out_proj biases follow ``use_bias``, the conv
bias ``use_conv_bias``, the conv activation ``mamba_hidden_act``; the time-step limit is
(``time_step_min``, inf) -- transformers ignores ``time_step_limit`` for this family. The
SSM state keeps the pool's dtype (``mamba_ssm_cache_dtype`` when the config sets it).
Legacy config names (``mamba_n_groups``, ``mamba_d_conv``, ``mamba_chunk_size``,
``mamba_conv_bias``, ``mamba_dt_min``) are read as transformers reads them. Checkpoints may
use NVIDIA's ``backbone.`` prefix and one tensor per expert; multi-token-prediction
(``mtp.``) weights are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.attention import PagedSelfAttention
from hybrid_pd.engine.models.common import (
    BackboneLM,
    RMSNorm,
    activation,
    add_routed,
    config_int,
    copy_weight,
)
from hybrid_pd.engine.models.mamba2 import (
    Mamba2Dims,
    Mamba2Mixer,
    check_state_spec,
    time_step_limit,
)
from hybrid_pd.engine.onednn import linear
from hybrid_pd.engine.tp.head import head_logits
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.specs import AttentionSpec, LayerSpec, StateSpec

_ARCH = "NemotronH"
_SYMBOLS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
_SKIP_PREFIXES = ("mtp.",)
_ONE_EXPERT = re.compile(r"(.+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight")


def _get(c: Mapping[str, Any], key: str, legacy: str | None, default: Any) -> Any:
    """transformers' order: the legacy name, when present, overrides the new one."""
    if legacy is not None and c.get(legacy) is not None:
        return c[legacy]
    value = c.get(key)
    return default if value is None else value


def _int(value: Any, key: str) -> int:
    return config_int(_ARCH, key, value)


def layer_kinds(c: Mapping[str, Any]) -> list[str]:
    """One of linear_attention / full_attention / mlp / moe per block."""
    kinds = c.get("layers_block_type") or c.get("layer_types")
    if kinds is None:
        pattern = c.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{_ARCH}: config has no layers_block_type / hybrid_override_pattern")
        bad = sorted({ch for ch in pattern if ch not in _SYMBOLS})
        if bad:
            raise ValueError(f"{_ARCH}: hybrid_override_pattern has unknown symbols {bad}")
        return [_SYMBOLS[ch] for ch in pattern]
    kinds = [_LEGACY.get(k, k) for k in kinds]
    bad = sorted(set(kinds) - set(_SYMBOLS.values()))
    if bad:
        raise ValueError(f"{_ARCH}: unknown block types {bad}")
    return kinds


class _Settings:
    """A Nemotron-H config dict, validated, with NemotronHConfig's defaults."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        c = config.get("text_config") or config
        self.vocab = _int(_get(c, "vocab_size", None, 131072), "vocab_size")
        self.hidden = _int(_get(c, "hidden_size", None, 4096), "hidden_size")
        self.intermediate = _int(_get(c, "intermediate_size", None, 21504), "intermediate_size")
        self.num_heads = _int(_get(c, "num_attention_heads", None, 32), "num_attention_heads")
        self.eps = float(_get(c, "layer_norm_epsilon", None, 1e-5))
        self.mlp_act = _get(c, "mlp_hidden_act", None, "relu2")
        self.mlp_bias = bool(_get(c, "mlp_bias", None, False))
        self.kinds = layer_kinds(c)
        if "moe" in self.kinds:
            self.n_experts = _int(_get(c, "n_routed_experts", "num_local_experts", 8), "experts")
            self.top_k = _int(_get(c, "num_experts_per_tok", None, 2), "num_experts_per_tok")
            self.moe_inter = _int(_get(c, "moe_intermediate_size", None, 7688), "moe size")
            self.shared_inter = _int(
                _get(c, "moe_shared_expert_intermediate_size", None, 7688), "shared expert size"
            )
            latent = c.get("moe_latent_size")
            self.latent = None if latent is None else _int(latent, "moe_latent_size")
            self.n_group = _int(_get(c, "n_group", None, 1), "n_group")
            self.topk_group = _int(_get(c, "topk_group", None, 1), "topk_group")
            self.norm_topk_prob = bool(_get(c, "norm_topk_prob", None, True))
            self.routed_scaling = float(_get(c, "routed_scaling_factor", None, 1.0))
            if self.n_experts % self.n_group:
                raise ValueError(f"{_ARCH}: {self.n_experts} experts in {self.n_group} groups")
        specs = cache_spec_from_config(dict(config), dtype="float32").layers
        self.specs: list[LayerSpec | None] = [
            specs.get(f"model.layers.{i}") for i in range(len(self.kinds))
        ]
        self.mamba = Mamba2Dims(
            hidden=self.hidden,
            heads=_int(_get(c, "mamba_num_heads", None, 128), "mamba_num_heads"),
            head_dim=_int(_get(c, "mamba_head_dim", None, 64), "mamba_head_dim"),
            groups=_int(_get(c, "n_groups", "mamba_n_groups", 8), "n_groups"),
            state=_int(_get(c, "ssm_state_size", None, 128), "ssm_state_size"),
            conv_kernel=_int(_get(c, "conv_kernel", "mamba_d_conv", 4), "conv_kernel"),
            chunk=_int(_get(c, "chunk_size", "mamba_chunk_size", 128), "chunk_size"),
            eps=self.eps,
            act=_get(c, "mamba_hidden_act", None, "silu"),
            conv_bias=bool(_get(c, "use_conv_bias", "mamba_conv_bias", True)),
            proj_bias=bool(_get(c, "use_bias", None, False)),
            # the clamp on dt is time_step_limit (time_step_min only sets dt_bias's init), as
            # in NVIDIA's code and transformers from 5.25 on (5.24 clamped at time_step_min)
            dt_limit=time_step_limit(_get(c, "time_step_limit", "mamba_dt_limit", None)),
        )


class MLP(nn.Module):
    """down(act(up(x))): no gate."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class Router(nn.Module):
    """Sigmoid scores; experts chosen by score + correction bias, within the `topk_group`
    expert groups whose two best biased scores sum highest; weights are the unbiased scores
    of the chosen experts, normalised to sum 1 (`norm_topk_prob`) and scaled."""

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(s.n_experts, s.hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(s.n_experts))
        self.top_k, self.n_group, self.topk_group = s.top_k, s.n_group, s.topk_group
        self.norm_topk_prob, self.scaling = s.norm_topk_prob, s.routed_scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], float32 weights [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        grouped = biased.view(x.shape[0], self.n_group, -1)
        group_best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_best, dtype=torch.bool)
        keep.scatter_(1, group_best.topk(self.topk_group, dim=-1).indices, True)
        biased = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Experts(nn.Module):
    """Non-gated expert MLPs as 3-d weights: up_proj [E, I, D], down_proj [E, D, I]."""

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        dim = s.latent or s.hidden
        self.up_proj = nn.Parameter(torch.empty(s.n_experts, s.moe_inter, dim))
        self.down_proj = nn.Parameter(torch.empty(s.n_experts, dim, s.moe_inter))
        self.act = activation(s.mlp_act)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)

        def contribution(e: int, token, slot) -> torch.Tensor:
            y = linear(self.act(linear(x[token], self.up_proj[e])), self.down_proj[e])
            return (y * weights[token, slot, None]).to(out.dtype)

        return add_routed(out, ids, contribution).to(x.dtype)


class MoE(nn.Module):
    """Routed experts (through an optional latent projection) plus one shared expert MLP."""

    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.gate = Router(s)
        self.experts = Experts(s)
        self.shared_experts = MLP(s.hidden, s.shared_inter, s.mlp_act, s.mlp_bias)
        if s.latent is not None:
            self.fc1_latent_proj = nn.Linear(s.hidden, s.latent, bias=s.mlp_bias)
            self.fc2_latent_proj = nn.Linear(s.latent, s.hidden, bias=s.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        h = self.experts(h, ids, weights)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


class Block(nn.Module):
    def __init__(self, s: _Settings, idx: int) -> None:
        super().__init__()
        name = f"model.layers.{idx}"
        kind, spec = s.kinds[idx], s.specs[idx]
        self.kind = kind
        self.norm = RMSNorm(s.hidden, s.eps)
        if kind == "linear_attention" and isinstance(spec, StateSpec):
            check_state_spec(s.mamba, spec, name, _ARCH)
            self.mixer = Mamba2Mixer(s.mamba, name)
        elif kind == "full_attention" and isinstance(spec, AttentionSpec):
            self.mixer = PagedSelfAttention(name, s.hidden, s.num_heads, spec)
        elif kind == "mlp" and spec is None:
            self.mixer = MLP(s.hidden, s.intermediate, s.mlp_act, s.mlp_bias)
        elif kind == "moe" and spec is None:
            self.mixer = MoE(s)
        else:
            raise ValueError(f"{_ARCH}: block {idx} is {kind!r} but its cache spec is {spec!r}")

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.norm(x)
        h = self.mixer(h) if self.kind in ("mlp", "moe") else self.mixer(h, batch)
        return x + h


class _Backbone(nn.Module):
    def __init__(self, s: _Settings) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(s, i) for i in range(len(s.kinds)))
        self.norm_f = RMSNorm(s.hidden, s.eps)


class NemotronHForCausalLM(BackboneLM):
    def __init__(self, config: dict) -> None:
        super().__init__(_Settings(config), _Backbone)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        embed = self.model.embeddings
        x = embed(batch.input_ids.to(embed.weight.device))
        for layer in self.model.layers:
            x = layer(x, batch)
        return self.model.norm_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight
        return head_logits(self, hidden, w, lambda h: F.linear(h, w)).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's tensors in (``backbone.`` read as ``model.``); unknown names,
        wrong shapes and missing weights raise (KeyError / ValueError), naming the tensor."""
        params = dict(self.named_parameters())
        params.update(self.named_buffers())  # the routers' e_score_correction_bias
        loaded: set[str] = set()
        experts: dict[str, set[int]] = {}
        for raw, tensor in weights:
            if raw.startswith(_SKIP_PREFIXES):
                continue
            key = "model." + raw[len("backbone.") :] if raw.startswith("backbone.") else raw
            one = _ONE_EXPERT.fullmatch(key)
            if one is not None:  # NVIDIA's layout: one 2-d tensor per expert
                key, index = f"{one[1]}.{one[3]}", int(one[2])
                param = params.get(key)
                if param is None or not 0 <= index < param.shape[0]:
                    raise KeyError(f"{_ARCH}: unexpected weight {raw!r}")
                copy_weight({key: param[index]}, key, tensor, _ARCH, raw)
                experts.setdefault(key, set()).add(index)
                if len(experts[key]) == param.shape[0]:
                    loaded.add(key)
                continue
            copy_weight(params, key, tensor, _ARCH, raw)
            loaded.add(key)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"{_ARCH}: weights missing from the checkpoint: {missing[:8]}")
