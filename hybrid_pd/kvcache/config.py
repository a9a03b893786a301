"""The result of grouping: KV cache groups that share one page size, and the page layout.

One block of the pool is one page of `page_size_bytes`. A group's block packs the group's
layers side by side, each in a slot of `slot_bytes` (aligned to `SLOT_ALIGN`):

    block b of group g:  | layer 0 slot | layer 1 slot | ... | layer m-1 slot | unused |
                         ^ b * page_size_bytes                                 ^ padding

A state group whose state is larger than one slot spreads each state over `blocks_per_state`
blocks (shard j of every layer's state lives in the request's j-th block of that group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from hybrid_pd.kvcache.specs import LayerSpec, StateSpec, cdiv, dtype_bytes

#: Byte alignment of every slot and of every tensor inside a state slot.
SLOT_ALIGN = 16


def align_up(n: int, a: int = SLOT_ALIGN) -> int:
    return cdiv(n, a) * a


@lru_cache(maxsize=256)
def state_tensor_offsets(spec: StateSpec) -> tuple[tuple[int, ...], int]:
    """Byte offset of each state tensor inside one (unsharded) state, and the aligned total."""
    offsets, pos = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        offsets.append(pos)
        pos = align_up(pos + math.prod(shape) * dtype_bytes(dtype))
    return tuple(offsets), pos


@lru_cache(maxsize=4096)
def slot_bytes_for(spec: LayerSpec, block_size: int, blocks_per_state: int = 1) -> int:
    """Aligned bytes one layer of `spec` takes in one block."""
    if isinstance(spec, StateSpec):
        _, total = state_tensor_offsets(spec)
        return align_up(cdiv(total, blocks_per_state))
    return align_up(spec.page_bytes(block_size))


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one spec that share block ids."""

    group_id: int
    spec: LayerSpec
    layer_names: tuple[str, ...]
    slot_bytes: int
    blocks_per_state: int = 1

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def is_state(self) -> bool:
        return isinstance(self.spec, StateSpec)

    def used_bytes_per_block(self, block_size: int) -> int:
        """Bytes of real data (no alignment or padding) one block of this group carries."""
        if isinstance(self.spec, StateSpec):
            return len(self.layer_names) * self.spec.state_bytes // self.blocks_per_state
        return len(self.layer_names) * self.spec.page_bytes(block_size)

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        return self.spec.blocks_needed(num_tokens, block_size) * self.blocks_per_state

    def slot_offset(self, layer_name: str) -> int:
        return self.layer_names.index(layer_name) * self.slot_bytes


@dataclass(frozen=True)
class KVCacheConfig:
    """Grouping of a model's cache layers for one pool."""

    block_size: int
    page_size_bytes: int
    groups: tuple[KVCacheGroup, ...]
    hma: bool = True
    strategy: str = ""
    shared_layers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for g in self.groups:
            if len(g.layer_names) * g.slot_bytes > self.page_size_bytes:
                raise ValueError(f"group {g.group_id} does not fit in one page")
        if self.page_size_bytes % SLOT_ALIGN:
            raise ValueError("page size must be a multiple of SLOT_ALIGN")

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_names) for g in self.groups)

    def group_of(self, layer_name: str) -> KVCacheGroup:
        """The group that stores `layer_name` (or the layer it shares KV with)."""
        group = self._group_by_layer.get(self.shared_layers.get(layer_name, layer_name))
        if group is None:
            raise KeyError(f"layer {layer_name!r} owns no KV cache in this config")
        return group

    @cached_property
    def _group_by_layer(self) -> dict[str, KVCacheGroup]:
        # layers ask for their group every step; a scan over the groups was measurable
        found: dict[str, KVCacheGroup] = {}
        for g in self.groups:
            for name in g.layer_names:
                found.setdefault(name, g)  # the first group that holds it, as a scan finds
        return found

    def padding_slots(self, group: KVCacheGroup) -> int:
        """Whole unused slots in the group's page (vLLM calls these padding layers)."""
        return self.page_size_bytes // group.slot_bytes - len(group.layer_names)

    def blocks_per_request(self, num_tokens: int) -> int:
        return sum(g.blocks_needed(num_tokens, self.block_size) for g in self.groups)

    def bytes_per_request(self, num_tokens: int) -> int:
        """Pool bytes a request of `num_tokens` tokens holds."""
        return self.blocks_per_request(num_tokens) * self.page_size_bytes

    def padding_bytes(self, num_tokens: int) -> int:
        """Bytes of a request's pages that hold no data because of padding (unused slots,
        padded states, alignment). Tokens not yet written in a last partial block are not
        counted: that is block rounding, not padding."""
        used = sum(
            g.blocks_needed(num_tokens, self.block_size) * g.used_bytes_per_block(self.block_size)
            for g in self.groups
        )
        return self.bytes_per_request(num_tokens) - used

    def padding_waste(self, num_tokens: int) -> float:
        """Fraction of a request's pool bytes that hold no data because of padding."""
        total = self.bytes_per_request(num_tokens)
        return self.padding_bytes(num_tokens) / total if total else 0.0
