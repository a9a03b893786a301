"""The KV layout two workers must share to exchange blocks, and its fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hybrid_pd.kvcache.config import KVCacheConfig

#: How the connector inside vLLM begins its layout's model name.
VLLM_PREFIX = "vllm:"


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

    @property
    def engine(self) -> str:
        """Whose cache this is: vLLM's (the connector inside vLLM names its model "vllm:...")
        or hybrid-pd's own engine."""
        return "vLLM" if self.model.startswith(VLLM_PREFIX) else "hybrid-pd"

    def describe(self) -> str:
        kinds = ", ".join(g.kind for g in self.groups)
        where = (
            "one cache tensor per layer, K and V apart"
            if self.engine == "vLLM"
            else f"one {self.page_size_bytes}-byte page per block holding a group's layers"
        )
        return f"{self.engine}: {where}; blocks of {self.block_size} tokens; groups {kinds}"

    def difference(self, other: KVLayout) -> str | None:
        """None when equal, else a message naming the first differing field."""
        if self.engine != other.engine:
            return (
                f"KV layout mismatch: the peer runs {other.engine} and this worker "
                f"{self.engine}, whose KV memory is laid out differently ({self.describe()} "
                f"here; {other.describe()} on the peer): hand-overs between the two engines "
                "are not supported"
            )
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
