"""The KV layout two workers must share to exchange blocks, and its fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hybrid_pd.kvcache.config import KVCacheConfig


@dataclass(frozen=True)
class GroupGeometry:
    kind: str
    spec: str
    num_layers: int
    slot_bytes: int
    blocks_per_state: int


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    page_size_bytes: int
    groups: tuple[GroupGeometry, ...]
    model: str

    @classmethod
    def of(cls, config: KVCacheConfig, model: str) -> KVLayout:
        return cls(
            config.block_size,
            config.page_size_bytes,
            tuple(
                GroupGeometry(
                    g.kind, repr(g.spec), len(g.layer_names), g.slot_bytes, g.blocks_per_state
                )
                for g in config.groups
            ),
            model,
        )

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:32]

    def difference(self, other: KVLayout) -> str | None:
        """None when equal, else a message naming the first differing field."""
        for name in ("model", "block_size", "page_size_bytes"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"KV layout mismatch: {name} is {a!r} here but {b!r} on the peer"
        if len(self.groups) != len(other.groups):
            return (
                f"KV layout mismatch: {len(self.groups)} KV cache groups here but "
                f"{len(other.groups)} on the peer"
            )
        for i, (a, b) in enumerate(zip(self.groups, other.groups, strict=True)):
            for name in ("kind", "spec", "num_layers", "slot_bytes", "blocks_per_state"):
                x, y = getattr(a, name), getattr(b, name)
                if x != y:
                    return (
                        f"KV layout mismatch: group {i} {name} is {x!r} here but {y!r} on the peer"
                    )
        return None
