"""Grouping: choose the block size and page size, and split layers into KV cache groups.

Every group of the pool shares one page size P. A group packs as many layers of one spec as
fit in P (each layer in an aligned slot). We search the attention block size B (tokens per
block, `min_block_size` to `max_block_size`), the page size P (candidates: a whole number of
one kind's slots) and, for state layers, how many blocks one state spans, and keep the plan that
allocates the fewest bytes for a request of `ref_len` tokens. Among plans within
`TOLERANCE` of the best we prefer in-place states (one block per state), then fewer groups,
then fewer bytes, then a block size that is a multiple of 16, then the smaller block size.

`vllm_style_config` reproduces the heuristic documented in vLLM's hybrid KV cache manager
design (attention block size raised until one layer's page holds a state, states padded,
groups of `min(layer count per type)` layers) so reports can compare the two.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from hybrid_pd.kvcache.config import KVCacheConfig, KVCacheGroup, align_up, slot_bytes_for
from hybrid_pd.kvcache.specs import (
    AttentionSpec,
    LayerSpec,
    ModelCacheSpec,
    StateSpec,
    cdiv,
)

logger = logging.getLogger(__name__)

TOLERANCE = 0.01
MAX_BLOCKS_PER_STATE = 8
#: A page holds at most this many whole states when the page size is taken from a state.
MAX_STATES_PER_PAGE = 4


class HMAOffError(ValueError):
    """The model cannot run with the hybrid manager turned off."""


def _kinds(layers: dict[str, LayerSpec]) -> dict[LayerSpec, list[str]]:
    """Layer names bucketed by spec, in order of first appearance."""
    kinds: dict[LayerSpec, list[str]] = {}
    for name, spec in layers.items():
        kinds.setdefault(spec, []).append(name)
    return kinds


@dataclass(frozen=True)
class _KindPlan:
    slot_bytes: int
    per_group: int
    num_groups: int
    blocks_per_state: int


@dataclass(frozen=True)
class _Plan:
    score: int
    block_size: int
    page: int
    kinds: tuple[_KindPlan, ...]

    @property
    def num_groups(self) -> int:
        return sum(k.num_groups for k in self.kinds)

    @property
    def max_span(self) -> int:
        return max(k.blocks_per_state for k in self.kinds)

    def preference(self) -> tuple:
        return (
            self.max_span,
            self.num_groups,
            self.score,
            self.block_size % 16 != 0,
            self.block_size,
        )


def _plan_kind(spec: LayerSpec, n: int, block_size: int, page: int) -> _KindPlan | None:
    spans = range(1, MAX_BLOCKS_PER_STATE + 1) if isinstance(spec, StateSpec) else (1,)
    best: _KindPlan | None = None
    for k in spans:
        slot = slot_bytes_for(spec, block_size, k)
        per_group = min(n, page // slot)
        if per_group == 0:
            continue
        plan = _KindPlan(slot, per_group, cdiv(n, per_group), k)
        if best is None or plan.num_groups * k < best.num_groups * best.blocks_per_state:
            best = plan
    return best


def _page_candidates(
    kinds: dict[LayerSpec, list[str]], block_size: int, min_page: int
) -> Iterator[int]:
    seen: set[int] = set()
    for spec, names in kinds.items():
        spans = range(1, MAX_BLOCKS_PER_STATE + 1) if isinstance(spec, StateSpec) else (1,)
        for k in spans:
            slot = slot_bytes_for(spec, block_size, k)
            most = min(len(names), MAX_STATES_PER_PAGE) if k > 1 or spans != (1,) else len(names)
            for count in range(1, most + 1):
                page = count * slot
                if page >= min_page and page not in seen:
                    seen.add(page)
                    yield page


def _block_sizes(
    block_size: int | None, min_block_size: int, max_block_size: int, block_align: int
) -> list[int]:
    if block_size is not None:
        if block_size <= 0:
            raise ValueError("--block-size must be positive")
        return [block_size]
    if block_align <= 0:
        raise ValueError("--block-align must be positive")
    first = cdiv(min_block_size, block_align) * block_align
    if max_block_size < first:
        raise ValueError(
            f"no block size between {min_block_size} and {max_block_size} is a multiple of "
            f"{block_align}"
        )
    return list(range(first, max_block_size + 1, block_align))


def plan_groups(
    model: ModelCacheSpec,
    *,
    block_size: int | None = None,
    min_block_size: int = 16,
    max_block_size: int = 64,
    block_align: int = 1,
    ref_len: int | None = None,
    hma: bool = True,
) -> KVCacheConfig:
    """Group `model`'s layers for one pool.

    `block_size` fixes the attention block size; otherwise every multiple of `block_align`
    from `min_block_size` to `max_block_size` is tried (small blocks make prefix caching
    fine-grained; below 16 tokens kernels and block tables get inefficient). `ref_len`
    (default: the model's max length, else 4096) is the request length whose pool bytes the
    search minimises. With `hma=False` sliding-window
    and chunked layers become full attention and state layers raise `HMAOffError`.
    """
    layers = model.layers if hma else _hma_off_layers(model)
    ref = ref_len or model.max_model_len or 4096
    kinds = _kinds(layers)
    best: list[_Plan] = []
    for bs in _block_sizes(block_size, min_block_size, max_block_size, block_align):
        attn_slots = [slot_bytes_for(s, bs) for s in kinds if not isinstance(s, StateSpec)]
        min_page = max(attn_slots, default=align_up(1))
        for page in _page_candidates(kinds, bs, min_page):
            plans = [_plan_kind(spec, len(names), bs, page) for spec, names in kinds.items()]
            if any(p is None for p in plans):
                continue
            blocks = sum(
                p.num_groups * spec.blocks_needed(ref, bs) * p.blocks_per_state
                for p, spec in zip(plans, kinds, strict=True)
            )
            best.append(_Plan(blocks * page, bs, page, tuple(plans)))  # type: ignore[arg-type]
    if not best:
        raise ValueError(f"{model.architecture}: no feasible grouping found")
    floor = min(p.score for p in best)
    chosen = min((p for p in best if p.score <= floor * (1 + TOLERANCE)), key=_Plan.preference)
    return _build(model, kinds, chosen, hma)


def _build(
    model: ModelCacheSpec, kinds: dict[LayerSpec, list[str]], plan: _Plan, hma: bool
) -> KVCacheConfig:
    groups: list[KVCacheGroup] = []
    for (spec, names), kp in zip(kinds.items(), plan.kinds, strict=True):
        # Spread layers evenly: sizes differ by at most one.
        base, extra = divmod(len(names), kp.num_groups)
        start = 0
        for i in range(kp.num_groups):
            size = base + (1 if i < extra else 0)
            chunk = tuple(names[start : start + size])
            start += size
            groups.append(
                KVCacheGroup(len(groups), spec, chunk, kp.slot_bytes, kp.blocks_per_state)
            )
    config = KVCacheConfig(
        block_size=plan.block_size,
        page_size_bytes=plan.page,
        groups=tuple(groups),
        hma=hma,
        strategy=_describe(plan, kinds),
        shared_layers=dict(model.shared),
    )
    logger.debug("grouping for %s: %s", model.architecture, config.strategy)
    return config


def _describe(plan: _Plan, kinds: dict[LayerSpec, list[str]]) -> str:
    parts = [f"block {plan.block_size} tokens, page {plan.page} B"]
    for spec, kp in zip(kinds, plan.kinds, strict=True):
        what = f"{kp.per_group} {spec.kind} layer(s) per page"
        if kp.blocks_per_state > 1:
            what += f", each state spread over {kp.blocks_per_state} blocks"
        parts.append(what)
    return "; ".join(parts)


def _hma_off_layers(model: ModelCacheSpec) -> dict[str, LayerSpec]:
    state = model.state_layers
    if state:
        shown = ", ".join(state[:6]) + (f", ... ({len(state)} in all)" if len(state) > 6 else "")
        raise HMAOffError(
            f"{model.architecture} has recurrent state layers ({shown}) that cannot be stored "
            "as full attention; keep the hybrid KV cache manager on (drop --no-hma)"
        )
    return {n: s.as_full() for n, s in model.layers.items()}  # type: ignore[union-attr]


def vllm_style_config(
    model: ModelCacheSpec, *, kernel_block_size: int = 16, hma: bool = True
) -> KVCacheConfig:
    """The grouping vLLM's documented heuristic would choose (for comparison only)."""
    layers = model.layers if hma else _hma_off_layers(model)
    kinds = _kinds(layers)
    attn = [s for s in kinds if isinstance(s, AttentionSpec)]
    states = [s for s in kinds if isinstance(s, StateSpec)]
    bs = kernel_block_size
    if attn and states:
        per_token = max(s.bytes_per_token for s in attn)
        largest = max(slot_bytes_for(s, bs) for s in states)
        bs = cdiv(cdiv(largest, per_token), kernel_block_size) * kernel_block_size
    slot = max(slot_bytes_for(s, bs) for s in kinds)
    group_size = min(len(v) for v in kinds.values())
    plans = tuple(_KindPlan(slot, group_size, cdiv(len(v), group_size), 1) for v in kinds.values())
    plan = _Plan(0, bs, group_size * slot, plans)
    config = _build(model, kinds, plan, hma)
    return config
