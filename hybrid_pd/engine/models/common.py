"""Building blocks shared by the architectures."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.onednn import FusedLinears

# float32 exp rounds to exactly 0 below this (the smallest denormal is exp(-103.28)).
EXP_ZERO = -104.0


def exp_or_zero(x: torch.Tensor, floor: torch.Tensor | float = EXP_ZERO) -> torch.Tensor:
    """exp(x) in place, entries below `floor` set to exactly 0.

    On CPU, float32 exp is 3-30x slower where its result is denormal or zero (-inf included),
    and the log decays of state layers make many such entries. Those below EXP_ZERO come out
    0 either way, so with the default floor the values are exp's own; exp sees 0 there
    instead. A tensor floor broadcasts: +inf masks an entry out (its result is 0)."""
    dead = x < floor
    return x.masked_fill_(dead, 0.0).exp_().masked_fill_(dead, 0.0)


def causal_exp_floor(size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """exp_or_zero's [size, size] floor for log decays from token j (column) to token i (row):
    EXP_ZERO where j <= i, +inf above the diagonal (no decay reaches an earlier token)."""
    floor = torch.full((size, size), EXP_ZERO, device=device)
    return floor.masked_fill_(torch.ones_like(floor, dtype=torch.bool).triu_(1), math.inf)


def routed_tokens(top_idx: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, tokens, slots) for every expert that `top_idx` [T, k] picks, experts ascending
    and each expert's tokens ascending: what `torch.nonzero(top_idx == e)` over
    `top_idx.unique()` gives, from one stable sort instead of a comparison and a nonzero per
    expert (a checkpoint with 64 experts ran 128 such ops per MoE layer and step)."""
    k = top_idx.shape[-1]
    flat = top_idx.flatten()
    order = flat.argsort(stable=True)
    tokens, slots = order // k, order % k
    start = 0
    for e, count in enumerate(torch.bincount(flat).tolist()):
        if count:
            yield e, tokens[start : start + count], slots[start : start + count]
        start += count


def add_routed(
    out: torch.Tensor,
    top_idx: torch.Tensor,
    contribution: Callable[[int, Any, Any], torch.Tensor],
) -> torch.Tensor:
    """out[t] += contribution(e, tokens, slots) for every expert e that `top_idx` [T, k]
    picks, experts ascending; `tokens` / `slots` index the rows of x and of the routing
    weights that went to e. Returns `out`.

    One token (a batch-1 decode step) takes `_add_one_token`: the same sums in the same order,
    bit for bit, without sorting or index tensors (the routed path's argsort, bincount,
    gathers and index_add cost about 0.1 ms per layer there)."""
    if top_idx.shape[0] == 1:
        return _add_one_token(out, top_idx, contribution)
    return _add_by_expert(out, top_idx, contribution)


def _add_by_expert(out, top_idx, contribution) -> torch.Tensor:
    for e, tokens, slots in routed_tokens(top_idx):
        out.index_add_(0, tokens, contribution(e, tokens, slots))
    return out


def _add_one_token(out, top_idx, contribution) -> torch.Tensor:
    """`tokens` is the slice of row 0, `slots` a plain int: views, not gathers."""
    row = slice(0, 1)
    for slot, e in sorted(enumerate(top_idx[0].tolist()), key=lambda se: se[1]):
        out += contribution(e, row, slot)
    return out


class BackboneLM(nn.Module):
    """A causal LM of a family's own backbone and an untied head: ``model`` is
    `backbone(settings)`, ``lm_head`` a [vocab, hidden] linear without bias (`settings`
    carries hidden and vocab). Modules are made in that order, the checkpoint's."""

    def __init__(self, settings: Any, backbone: Callable[[Any], nn.Module]) -> None:
        super().__init__()
        self.settings = settings
        self.model = backbone(settings)
        self.lm_head = nn.Linear(settings.hidden, settings.vocab, bias=False)


class RMSNorm(nn.Module):
    """RMS norm; `offset=1.0` gives the (1 + weight) form (Gemma, Qwen3.5) with zero init.

    The weight multiplies in float32 before the cast back (Gemma, Qwen3.5), or with
    `scale_after_cast` in the input dtype after it (Llama, Mistral, Qwen2/3: the same in
    float32, a different rounding in bfloat16)."""

    def __init__(
        self, dim: int, eps: float = 1e-6, offset: float = 0.0, scale_after_cast: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.scale_after_cast = scale_after_cast
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # one C pass on the CPU (float32, or bfloat16 with the roundings below)
        fused = cpu_kernels.rms_norm(x, self.weight, self.eps, self.offset, self.scale_after_cast)
        if fused is not None:
            return fused
        if dtype is torch.float32:
            # the same operations as below, in one call: no dtype casts to tell them apart
            weight = self.weight + self.offset if self.offset else self.weight
            return F.rms_norm(x, self.weight.shape, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_after_cast:
            return (self.offset + self.weight) * xf.to(dtype)
        return (xf * (self.offset + self.weight.float())).to(dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(
        self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self._gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x)
        return self.down_proj(act_times(self.act, gate, up))


def act_times(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up: SiLU's and GELU-tanh's in one C pass where the kernel applies
    (`cpu_kernels.act_mul`: 1.9-2.2 against 3.2-3.6 ms for SiLU at 2,048 x 1,536 on one
    thread), else PyTorch's two."""
    name = "silu" if act is F.silu else "gelu_tanh" if act is gelu_tanh else None
    if name is not None:
        out = cpu_kernels.act_mul(name, gate, up)
        if out is not None:
            return out
    return act(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def activation(name: str):
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return gelu_tanh
    if name == "gelu":
        return F.gelu
    if name == "relu2":  # squared ReLU (Nemotron-H)
        return lambda x: torch.square(F.relu(x))
    raise ValueError(f"unsupported activation {name!r}")


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half layout) over the first `rotary_dim` dims."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        rotary_dim: int | None = None,
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2).float() / self.rotary_dim))
        self.register_buffer("inv_freq", inv / scaling_factor, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D], positions [T] -> x with the rotary part rotated."""
        freqs = positions.float()[:, None] * self.inv_freq.to(x.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = (rot.float() * cos + rotated.float() * sin).to(x.dtype)
        return torch.cat([out, rest], dim=-1)


def copy_weight(
    params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, arch: str, shown: str
) -> None:
    """Copy a checkpoint tensor into parameter `name`; `shown` is the checkpoint's own name
    for messages. Unknown names raise KeyError, wrong shapes ValueError."""
    param = params.get(name)
    if param is None:
        raise KeyError(f"{arch}: unexpected weight {shown!r}")
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{arch}: weight {shown!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    param.copy_(tensor.to(param.dtype))


#: A checkpoint tensor -> (parameter name, tensor) pairs to copy; none: skip it.
Convert = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], arch: str, convert: Convert
) -> None:
    """Copy a checkpoint's tensors into `model` (each through `convert`); a tied head
    (`model.lm_head is None`) skips `lm_head.weight`. Unknown names, wrong shapes and missing
    weights raise (KeyError / ValueError), naming the tensor."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        for key, part in convert(name, tensor):
            if key == "lm_head.weight" and getattr(model, "lm_head", None) is None:
                continue  # tied to the embedding
            copy_weight(params, key, part, arch, name)
            loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"{arch}: weights missing from the checkpoint: {missing[:8]}")


def check_transposed(arch: str, name: str, tensor: torch.Tensor, param, perm) -> None:
    """A checkpoint tensor stored with its dims in another order than ours: its shape must be
    our parameter's permuted by `perm` (checked before the tensor is reordered, so a tensor
    already in our order cannot slip through); no parameter: nothing to check here
    (`copy_weight` names the unexpected tensor)."""
    if param is None:
        return
    want = tuple(param.shape[p] for p in perm)
    if tuple(tensor.shape) != want:
        raise ValueError(
            f"{arch}: weight {name!r} has shape {tuple(tensor.shape)}, expected {want}"
        )


def config_int(arch: str, key: str, value: Any, low: int = 1) -> int:
    """A config field's integer (a float holding one is accepted) of at least `low`; else
    ValueError naming the architecture and the field."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{arch}: config field {key!r} must be {what}, got {value!r}")
    return value


class DecoderSettings:
    """Base of a model's settings: the fields every decoder config has."""

    vocab: int
    hidden: int
    intermediate: int
    num_heads: int
    eps: float
    act: str
    tie: bool

    def read_decoder(self, arch: str, c: Mapping[str, Any], *, vocab: int, eps: float) -> None:
        """Read them from config `c` with `arch`'s defaults (`vocab`, `eps`; hidden 4096,
        intermediate 14336, 32 heads, silu, untied); ValueError for a size that is not a
        positive integer."""
        self.vocab = config_int(arch, "vocab_size", c.get("vocab_size", vocab))
        self.hidden = config_int(arch, "hidden_size", c.get("hidden_size", 4096))
        self.intermediate = config_int(arch, "intermediate_size", c.get("intermediate_size", 14336))
        self.num_heads = config_int(arch, "num_attention_heads", c.get("num_attention_heads", 32))
        self.eps = float(c.get("rms_norm_eps") or eps)
        self.act = c.get("hidden_act") or "silu"
        self.tie = bool(c.get("tie_word_embeddings") or False)
