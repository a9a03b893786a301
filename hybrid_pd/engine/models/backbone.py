"""The decoder stack that the RoPE-everywhere models share (the Llama family, gpt-oss,
Llama 4): checkpoint names ``embed_tokens``, ``layers.{i}``, ``norm``, and the RoPE inverse
frequencies, kept as a plain attribute, not a buffer: the loader's model.to(dtype) must not
round them to bfloat16 (transformers keeps them in float32 too)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine.batch import ForwardBatch
from hybrid_pd.engine.models.common import RMSNorm, load_checkpoint
from hybrid_pd.engine.models.rope import RopeSettings, inverse_frequencies
from hybrid_pd.engine.tp.head import head_logits
from hybrid_pd.kvcache.specs import AttentionSpec, StateSpec

#: (inv_freq, positions, rope_scale, dtype) -> (cos, sin), the tables every layer receives.
RopeTables = Callable[
    [torch.Tensor, torch.Tensor, float, torch.dtype], tuple[torch.Tensor, torch.Tensor]
]


class RopeBackbone(nn.Module):
    """Embedding, decoder layers called as ``layer(x, cos, sin, batch)``, final norm."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        num_layers: int,
        make_layer: Callable[[int], nn.Module],
        make_norm: Callable[[], nn.Module],
        rope: RopeSettings,
        head_dim: int,
    ) -> None:
        """Modules are made in checkpoint order (embedding, layers, norm), as the models
        made them before they shared this class."""
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(make_layer(i) for i in range(num_layers))
        self.norm = make_norm()
        self.inv_freq, self.rope_scale = inverse_frequencies(rope, head_dim)

    def run(self, batch: ForwardBatch, tables: RopeTables) -> torch.Tensor:
        """The final hidden states [T, hidden] of `batch`'s tokens."""
        embed = self.embed_tokens
        x = embed(batch.input_ids.to(embed.weight.device))
        positions = batch.positions.to(x.device)
        cos, sin = tables(self.inv_freq, positions, self.rope_scale, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        return self.norm(x)


class RopeCausalLM(nn.Module):
    """A causal LM over a `RopeBackbone`: ``model`` and, unless the embedding is tied,
    ``lm_head``. `settings` carries vocab, hidden, tie, rope, head_dim and one spec per layer
    (`specs`); layer i is `layer(settings, i)`; `tables` makes the RoPE tables its layers
    take."""

    def __init__(
        self,
        config: dict,
        settings,
        layer: Callable[..., nn.Module],
        make_norm: Callable[[], nn.Module],
        tables: RopeTables,
    ) -> None:
        super().__init__()
        self.settings = s = settings
        self.config = config
        self.model = RopeBackbone(
            s.vocab,
            s.hidden,
            len(s.specs),
            lambda i: layer(s, i),
            make_norm,
            s.rope,
            s.head_dim,
        )
        self.lm_head = None if s.tie else nn.Linear(s.hidden, s.vocab, bias=False)
        self._tables = tables

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.run(batch, self._tables)

    #: The architecture's name, in load errors.
    arch: str = ""

    def convert(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """(our name, tensor) pairs for the checkpoint's tensor `name` (`params`: ours by
        name); here the tensor under its own name."""
        return ((name, tensor),)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's tensors in, each through `convert`; unknown names, wrong
        shapes and missing weights raise (KeyError / ValueError), naming the tensor."""
        params = dict(self.named_parameters())
        load_checkpoint(self, weights, self.arch, lambda n, t: self.convert(n, t, params))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        w = head.weight
        return head_logits(self, hidden, w, lambda h: F.linear(h, w))


class LayerStack(nn.Module):
    """Embedding, decoder layers, final norm under the names Bamba, Jamba and Falcon-H1
    checkpoints use: ``embed_tokens``, ``layers.{i}``, ``final_layernorm``."""

    def __init__(
        self, vocab: int, hidden: int, layers: Iterable[nn.Module], final_norm: nn.Module
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = final_norm


class MixerOrAttentionLayer(nn.Module):
    """A Bamba or Jamba layer: ``input_layernorm``, then a Mamba mixer (``mamba``) or
    attention (``self_attn``) as the layer's cache spec says, added; ``pre_ff_layernorm``
    and ``feed_forward``, added. `mixer` / `attention` make the module for a state / an
    attention layer from (layer name, spec); the layer's forward passes what follows the
    batch to the attention only (Bamba's RoPE tables)."""

    def __init__(
        self,
        s,
        idx: int,
        arch: str,
        feed_forward: nn.Module,
        mixer: Callable[[str, StateSpec], nn.Module],
        attention: Callable[[str, AttentionSpec], nn.Module],
    ) -> None:
        super().__init__()
        name = f"model.layers.{idx}"
        spec = s.specs[idx]
        self.input_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)
        self.pre_ff_layernorm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)
        self.feed_forward = feed_forward
        if isinstance(spec, StateSpec):
            self.mamba = mixer(name, spec)
            self.self_attn = None
        elif isinstance(spec, AttentionSpec):
            self.self_attn = attention(name, spec)
            self.mamba = None
        else:
            raise ValueError(f"{arch}: {name} has an unexpected cache spec {spec!r}")

    def forward(self, x: torch.Tensor, batch: ForwardBatch, *attention_inputs) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.mamba is not None:
            h = self.mamba(h, batch)
        else:
            h = self.self_attn(h, batch, *attention_inputs)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class StackCausalLM(nn.Module):
    """A causal LM over a `LayerStack` (``model``) and, unless the embedding is tied,
    ``lm_head``. Each layer is called as ``layer(x, *self.layer_inputs(batch, x))``;
    `settings` carries vocab, hidden and tie."""

    #: The architecture's name (in load errors) and the checkpoint tensors `load_weights`
    #: skips (any whose name holds one of these).
    arch: str = ""
    ignored: tuple[str, ...] = ()

    def __init__(self, settings, make_layer: Callable[[int], nn.Module], num_layers: int) -> None:
        """`settings` carries vocab, hidden, eps and tie; the final norm is an RMSNorm
        scaled after the cast back."""
        super().__init__()
        self.settings = s = settings
        layers = (make_layer(i) for i in range(num_layers))
        final_norm = RMSNorm(s.hidden, s.eps, scale_after_cast=True)
        self.model = LayerStack(s.vocab, s.hidden, layers, final_norm)
        self.lm_head = None if s.tie else nn.Linear(s.hidden, s.vocab, bias=False)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        embed = self.model.embed_tokens
        return embed(batch.input_ids.to(embed.weight.device))

    def layer_inputs(self, batch: ForwardBatch, x: torch.Tensor) -> tuple:
        """What every layer takes after the hidden states (here: the batch)."""
        return (batch,)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed(batch)
        inputs = self.layer_inputs(batch, x)
        for layer in self.model.layers:
            x = layer(x, *inputs)
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        w = head.weight
        return head_logits(self, hidden, w, lambda h: F.linear(h, w))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's tensors in under their own names, but the `ignored` ones
        (see `load_checkpoint`)."""

        def convert(key: str, tensor: torch.Tensor):
            return () if any(part in key for part in self.ignored) else ((key, tensor),)

        load_checkpoint(self, weights, self.arch, convert)


def attention_geometry(arch: str, specs: list[AttentionSpec]) -> tuple[int, int]:
    """(head_dim, KV heads) that every layer of `specs` shares; ValueError naming `arch`
    where they disagree."""
    head_dims = {s.head_dim for s in specs}
    kv_heads = {s.num_kv_heads for s in specs}
    if len(head_dims) != 1 or len(kv_heads) != 1:
        raise ValueError(f"{arch}: layers disagree on head_dim / KV heads")
    return head_dims.pop(), kv_heads.pop()


def routed_experts(
    arch: str, read: Callable[[str, int], int], experts: int, top_k: int
) -> tuple[int, int]:
    """(experts, experts per token) of a mixture of experts whose config names them
    `num_local_experts` and `num_experts_per_tok` (`read(key, default)` reads one, the
    defaults given); ValueError naming `arch` when a token would take more than there are."""
    num_experts = read("num_local_experts", experts)
    per_token = read("num_experts_per_tok", top_k)
    if per_token > num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok exceeds num_local_experts")
    return num_experts, per_token
