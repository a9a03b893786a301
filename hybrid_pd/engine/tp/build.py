"""Build one rank's shard of a model from the whole checkpoint."""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybrid_pd.engine.tp.group import TPGroup
from hybrid_pd.engine.tp.head import install_vocab_shard
from hybrid_pd.engine.tp.plans.base import TPPlan
from hybrid_pd.engine.tp.shard import shard_tensor

logger = logging.getLogger(__name__)


@torch.no_grad()
def shard_model(full: nn.Module, rank_model: nn.Module, plan: TPPlan, group: TPGroup) -> None:
    """Copy `group.rank`'s share of every parameter of `full` (the model at TP 1, weights
    loaded) into `rank_model` (built from `plan.rank_config`), then wire the all-reduces,
    the head's split by vocabulary rows (`head`) and the plan's patch. Raises ValueError
    naming a parameter whose shard does not fit."""
    source = dict(full.named_parameters(remove_duplicate=False))
    for name, param in rank_model.named_parameters(remove_duplicate=False):
        if name not in source:
            raise ValueError(f"tensor parallelism: {name} has no counterpart in the checkpoint")
        param.copy_(_shard(name, source[name], param, plan, group))
    copy_buffers(full, rank_model, plan, group)
    install_reductions(rank_model, plan, group)
    install_vocab_shard(rank_model, group, plan.rank_config)
    if plan.patch is not None:
        plan.patch(rank_model, group)


def copy_buffers(full: nn.Module, rank_model: nn.Module, plan: TPPlan, group: TPGroup) -> None:
    """Copy the checkpoint's buffers (the persistent ones, such as Nemotron-H's router
    correction bias) like parameters: whole unless a rule names them. Non-persistent
    buffers are derived from the rank config by the model itself (Falcon-H1's muP vector)."""
    params = {name for name, _ in rank_model.named_parameters(remove_duplicate=False)}
    source = full.state_dict(keep_vars=True)
    for name, buf in rank_model.state_dict(keep_vars=True).items():
        if name in params:
            continue
        buf.copy_(_shard(name, source[name], buf, plan, group, "buffer "))


def install_reductions(model: nn.Module, plan: TPPlan, group: TPGroup) -> int:
    """All-reduce the output of every module the plan names (forward hooks); returns how
    many. Fails when the plan names none: a plan that matches nothing would run each
    rank's partial sums as if they were whole."""
    count = 0
    for name, module in model.named_modules():
        if plan.reduces(name):
            module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))
            count += 1
    if count == 0:
        raise ValueError("tensor parallelism: the plan's all-reduce points match no module")
    logger.debug("tensor parallelism: %d all-reduce points", count)
    return count


def _shard(
    name: str,
    whole: torch.Tensor,
    target: torch.Tensor,
    plan: TPPlan,
    group: TPGroup,
    kind: str = "",
) -> torch.Tensor:
    """This rank's part of checkpoint tensor `whole` (all of it unless a rule names it);
    ValueError when it does not fit `target`, the rank model's tensor."""
    rule = plan.params.rule_for(name)
    part = whole if rule is None else shard_tensor(whole, rule, group.size, group.rank)
    if tuple(part.shape) != tuple(target.shape):
        raise ValueError(
            f"tensor parallelism: {kind}{name}'s shard has shape {tuple(part.shape)}, the rank "
            f"model expects {tuple(target.shape)}"
        )
    return part
