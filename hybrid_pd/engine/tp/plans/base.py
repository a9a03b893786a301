"""What every family's tensor-parallel plan is made of.

A rank builds its model from a *rank config*: the checkpoint's config with every split
count (attention and KV heads, GDN key / value heads, Mamba2 heads and groups, MLP and
expert widths) replaced by its share, and every derived size (head dims, the Mamba2 inner
size) written out, so each family's own code builds a model of one rank's shape and its
cache specs give one rank's pool. Weights then split by parameter name (`ParamRules`);
the outputs of row-parallel modules (attention's o_proj, an MLP's down projection, a
mixer's out_proj, a whole MoE block) are all-reduced.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hybrid_pd.engine.tp.shard import LEADER_ONLY, ParamRules, Rule, Seg, Split


@dataclass(frozen=True)
class TPPlan:
    """What one rank of `size` needs to build and run its shard of a model."""

    size: int
    rank_config: dict
    params: ParamRules
    #: Module-name patterns (fullmatch) whose outputs are partial sums to all-reduce.
    reduce: tuple[str, ...]
    #: Changes the built rank model needs beyond sizes (model, group) -> None.
    patch: Callable[[nn.Module, Any], None] | None = field(default=None, compare=False)

    def reduces(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.reduce)


class TPConfigError(ValueError):
    """The model cannot be split over that many ranks (the message says why)."""


def text_config(cfg: Mapping[str, Any]) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), Mapping) else cfg


def rank_config(cfg: Mapping[str, Any]) -> tuple[dict, dict]:
    """A deep copy of the checkpoint's config, to be rewritten into one rank's, and the
    part of it that holds the text model's sizes (`text_config`)."""
    rank = copy.deepcopy(cfg)
    return rank, text_config(rank)


def config_int(text: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = text.get(key, default)
    if value is None:
        raise TPConfigError(f"config field {key!r} is needed to split the model")
    return int(value)


def divide(what: str, count: int, size: int, replicate: bool = False) -> int:
    """Each rank's share of `count` units (1 for a replicated unit)."""
    if count % size == 0:
        return count // size
    if replicate and size % count == 0:
        return 1
    how = "a divisor or a multiple" if replicate else "a divisor"
    raise TPConfigError(f"tensor-parallel size {size} must be {how} of {what} ({count})")


# ------------------------------------------------------------------------- shared rules


def attention_rules(prefix: str, heads: int, kv_heads: int, head_dim: int, q_width: int = 0):
    """q / k / v / o of attention modules named `prefix` (a pattern). `q_width`: rows per
    query head when they are not head_dim (Qwen3.5's gate rides with its query)."""
    return (
        (rf"{prefix}\.q_proj\.(weight|bias)", Split(0, (Seg(heads, q_width or head_dim),))),
        (rf"{prefix}\.[kv]_proj\.(weight|bias)", Split(0, (Seg(kv_heads, head_dim, True),))),
        (rf"{prefix}\.o_proj\.weight", Split(1, (Seg(heads, head_dim),))),
        (rf"{prefix}\.o_proj\.bias", LEADER_ONLY),
    )


def gated_mlp_rules(prefix: str, inter: int) -> tuple[tuple[str, Rule], ...]:
    """gate / up (column-parallel) and down (row-parallel) of a GatedMLP named `prefix`."""
    return (
        (rf"{prefix}\.(gate|up)_proj\.(weight|bias)", Split(0, (Seg(inter),))),
        (rf"{prefix}\.down_proj\.weight", Split(1, (Seg(inter),))),
        (rf"{prefix}\.down_proj\.bias", LEADER_ONLY),
    )


def split_width(text: dict, key: str, size: int, default: Any = None) -> int:
    """Writes the rank's share of the width `key` (an MLP's or the experts' intermediate
    size) into `text`; returns the whole model's."""
    whole = config_int(text, key, default)
    text[key] = divide(key, whole, size)
    return whole


def split_attention(
    text: dict, size: int, prefix: str = r".*\.self_attn", gated_query: bool = False
) -> tuple[tuple[tuple[str, Rule], ...], int]:
    """Writes the rank's attention sizes into `text` (`attention_sizes`); returns the rules
    of the attention modules named `prefix` and the whole model's query-head count.
    `gated_query`: each query head's rows are followed by its gate's (Qwen3.5)."""
    heads, kv, head_dim = attention_sizes(text, size)
    q_width = 2 * head_dim if gated_query else 0
    return attention_rules(prefix, heads, kv, head_dim, q_width), heads


def attention_sizes(text: dict, size: int) -> tuple[int, int, int]:
    heads = config_int(text, "num_attention_heads")
    kv = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or config_int(text, "hidden_size") // heads)
    text["num_attention_heads"] = divide("num_attention_heads", heads, size)
    text["num_key_value_heads"] = divide("num_key_value_heads", kv, size, replicate=True)
    text["head_dim"] = head_dim
    return heads, kv, head_dim


def mamba2_rules(prefix: str, heads: int, head_dim: int, groups: int, state: int):
    """A Mamba2Mixer named `prefix`: in_proj rows [z | x | B | C | dt], conv channels
    [x | B | C], per-head vectors, the gated norm's weight, out_proj columns."""
    hp, gn = Seg(heads, head_dim), Seg(groups, state, True)
    return (
        (rf"{prefix}\.in_proj\.(weight|bias)", Split(0, (hp, hp, gn, gn, Seg(heads)))),
        (rf"{prefix}\.conv1d\.(weight|bias)", Split(0, (hp, gn, gn))),
        (rf"{prefix}\.(dt_bias|A_log|D)", Split(0, (Seg(heads),))),
        (rf"{prefix}\.norm\.weight", Split(0, (hp,))),
        (rf"{prefix}\.out_proj\.weight", Split(1, (hp,))),
        (rf"{prefix}\.out_proj\.bias", LEADER_ONLY),
    )


def mamba2_heads(text: dict, size: int, inner: int) -> tuple[int, int, int, int]:
    """The Mamba2 head / group fields of Granite-4.0-H, Bamba and Falcon-H1 for an inner
    size `inner`: writes the rank's heads, groups and head dim into `text`; returns the
    whole model's (heads, head_dim, groups, state)."""
    heads = config_int(text, "mamba_n_heads", 128)
    groups = config_int(text, "mamba_n_groups", 1)
    state = config_int(text, "mamba_d_state", 256)
    d_head = text.get("mamba_d_head", "auto")
    head_dim = inner // heads if d_head in (None, "auto") else int(d_head)
    text["mamba_n_heads"] = divide("mamba_n_heads", heads, size)
    text["mamba_n_groups"] = divide("mamba_n_groups", groups, size, replicate=True)
    text["mamba_d_head"] = head_dim
    return heads, head_dim, groups, state


def split_mamba2_expand(
    text: dict, size: int, prefix: str
) -> tuple[tuple[tuple[str, Rule], ...], int, int]:
    """Granite-4.0-H's and Bamba's Mamba2 mixers named `prefix` (inner size
    ``mamba_expand * hidden``): writes the rank's sizes into `text` (`mamba2_heads`, and
    the expand); returns the mixers' rules, the whole model's group count and inner size."""
    hidden = config_int(text, "hidden_size")
    expand = float(text.get("mamba_expand") or 2)
    inner = int(expand * hidden)
    heads, head_dim, groups, state = mamba2_heads(text, size, inner)
    text["mamba_expand"] = expand / size
    if int(text["mamba_expand"] * hidden) != inner // size:
        raise TPConfigError(f"the Mamba2 inner size {inner} does not split over {size} ranks")
    return mamba2_rules(prefix, heads, head_dim, groups, state), groups, inner


def span_mamba2_norms(groups: int, inner: int, before_gate: bool = False):
    """A plan patch for Mamba2 mixers (and their subclasses) with fewer groups than ranks:
    each gated norm group then spans several ranks (`norms.SpannedGatedRMSNorm`;
    `before_gate`: the norm applies to y before the gate, Falcon-H1's
    ``mamba_norm_before_gate``). Mixers without a norm are left alone."""

    def patch(model: nn.Module, group) -> None:
        from hybrid_pd.engine.models.mamba2 import Mamba2Mixer
        from hybrid_pd.engine.tp.norms import SpannedGatedRMSNorm

        for module in list(model.modules()):
            norm = getattr(module, "norm", None)
            if isinstance(module, Mamba2Mixer) and norm is not None:
                module.norm = SpannedGatedRMSNorm(
                    norm, group, groups, inner // groups, before_gate=before_gate
                )

    return patch
