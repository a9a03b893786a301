"""Jamba: Mamba1 or attention per layer, a SwiGLU MLP or a MoE of them."""

from __future__ import annotations

import math

from hybrid_pd.engine.tp.plans import base
from hybrid_pd.engine.tp.shard import LEADER_ONLY, ParamRules, Seg, Split


def plan(cfg: dict, size: int) -> base.TPPlan:
    """Jamba: attention heads split as in the dense plans; each Mamba1 mixer's inner channels
    split with their conv and SSM state rows (in_proj [x | z], conv1d, dt_proj, A_log, D),
    x_proj row-parallel: its (dt, B, C) are sums over every inner channel, so they are
    all-reduced before the dt / B / C norms and dt_proj, which then run whole on every rank;
    out_proj row-parallel. An MLP or every expert of a MoE splits its width; the whole
    feed-forward block is all-reduced once."""
    rank, text = base.rank_config(cfg)
    rules, _ = base.split_attention(text, size)
    hidden = base.config_int(text, "hidden_size")
    expand = base.config_int(text, "mamba_expand", 2)
    if expand % size:
        # the model and the cache planner read the inner size as mamba_expand (an integer)
        # times hidden_size, so a rank's inner size must be a whole multiple of hidden_size
        raise base.TPConfigError(
            f"tensor-parallel size {size} must be a divisor of mamba_expand ({expand}): "
            "Jamba's Mamba inner size is mamba_expand x hidden_size, an integer multiple on "
            "every rank"
        )
    inner = expand * hidden
    text["mamba_expand"] = expand // size
    dt_rank = text.get("mamba_dt_rank", "auto")
    text["mamba_dt_rank"] = math.ceil(hidden / 16) if dt_rank in (None, "auto") else int(dt_rank)
    inter = base.split_width(text, "intermediate_size", size)
    ch = (Seg(inner),)
    rules += (
        (r".*\.mamba\.in_proj\.(weight|bias)", Split(0, (Seg(inner), Seg(inner)))),
        (r".*\.mamba\.(conv1d|dt_proj)\.(weight|bias)", Split(0, ch)),
        (r".*\.mamba\.(A_log|D)", Split(0, ch)),
        (r".*\.mamba\.(x_proj|out_proj)\.weight", Split(1, ch)),
        (r".*\.mamba\.(x_proj|out_proj)\.bias", LEADER_ONLY),
        (
            r".*\.feed_forward(\.experts\.\d+)?\.(gate|up)_proj\.(weight|bias)",
            Split(0, (Seg(inter),)),
        ),
        (r".*\.feed_forward(\.experts\.\d+)?\.down_proj\.weight", Split(1, (Seg(inter),))),
        (r".*\.feed_forward(\.experts\.\d+)?\.down_proj\.bias", LEADER_ONLY),
    )
    reduce = (
        r".*\.self_attn\.o_proj",
        r".*\.mamba\.x_proj",
        r".*\.mamba\.out_proj",
        r".*\.feed_forward",
    )
    return base.TPPlan(size, rank, ParamRules(rules), reduce)
