"""The KV layout two workers must share to exchange blocks, and its fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hybrid_pd.kvcache.config import KVCacheConfig
from hybrid_pd.kvcache.tp_layout import SlotRows, TPLayoutError, slot_rows

#: How the connector inside vLLM begins its layout's model name.
VLLM_PREFIX = "vllm:"


@dataclass(frozen=True)
class GroupGeometry:
    kind: str
    spec: str
    num_layers: int
    slot_bytes: int
    blocks_per_state: int
    #: The slot's tensors as this worker's ranks hold them (kvcache.tp_layout); empty
    #: where not described.
    rows: tuple[SlotRows, ...] = ()


@dataclass(frozen=True)
class KVLayout:
    """One rank's pool geometry (all ranks of a worker hold the same), with the number of
    ranks. Page and slot sizes are one rank's."""

    block_size: int
    page_size_bytes: int
    groups: tuple[GroupGeometry, ...]
    model: str
    tp_size: int = 1

    @classmethod
    def of(
        cls, config: KVCacheConfig, model: str, full: KVCacheConfig | None = None, tp_size: int = 1
    ) -> KVLayout:
        """`full`: the whole model's grouping when `config` is one TP rank's (default:
        `config` itself, TP 1)."""
        full = full or config
        groups = []
        for g, whole in zip(config.groups, full.groups, strict=True):
            try:
                rows = slot_rows(whole.spec, g.spec, config.block_size)
            except TPLayoutError:
                rows = ()
            groups.append(
                GroupGeometry(
                    g.kind,
                    repr(g.spec),
                    len(g.layer_names),
                    g.slot_bytes,
                    g.blocks_per_state,
                    rows,
                )
            )
        return cls(config.block_size, config.page_size_bytes, tuple(groups), model, tp_size)

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
        same_tp = self.tp_size == other.tp_size
        for name in ("model", "block_size", "page_size_bytes")[: 3 if same_tp else 2]:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                hint = ""
                if name == "block_size" and not same_tp and self.engine == "vLLM":
                    hint = (
                        " (vLLM sizes a hybrid model's blocks by its per-rank pages, which "
                        "differ between TP sizes: give both servers the same --block-size)"
                    )
                return f"KV layout mismatch: {name} is {a!r} here but {b!r} on the peer{hint}"
        if len(self.groups) != len(other.groups):
            return (
                f"KV layout mismatch: {len(self.groups)} KV cache groups here but "
                f"{len(other.groups)} on the peer"
            )
        if self.tp_size != other.tp_size:
            return self._tp_difference(other)
        for i, (a, b) in enumerate(zip(self.groups, other.groups, strict=True)):
            for name in ("kind", "spec", "num_layers", "slot_bytes", "blocks_per_state"):
                x, y = getattr(a, name), getattr(b, name)
                if x != y:
                    return (
                        f"KV layout mismatch: group {i} {name} is {x!r} here but {y!r} on the peer"
                    )
        return None

    def _tp_difference(self, other: KVLayout) -> str | None:
        """Pools of TP groups of different sizes map onto each other when every group has
        the same kind, layers and blocks per state, one block per state, and slot rows
        described the same way (kvcache.tp_layout); else a message naming what differs."""
        pair = f"tensor-parallel size {self.tp_size} here and {other.tp_size} on the peer"
        for i, (a, b) in enumerate(zip(self.groups, other.groups, strict=True)):
            for name in ("kind", "num_layers", "blocks_per_state"):
                x, y = getattr(a, name), getattr(b, name)
                if x != y:
                    return f"KV layout mismatch ({pair}): group {i} {name} is {x!r} / {y!r}"
            if a.blocks_per_state != 1:
                return (
                    f"KV layout mismatch ({pair}): group {i} spreads a state over "
                    f"{a.blocks_per_state} blocks, which moves only between equal TP sizes"
                )
            if not a.rows or len(_shapes(a.rows)) != len(_shapes(b.rows)):
                return (
                    f"KV layout mismatch ({pair}): group {i} ({a.kind}) does not describe "
                    "its slot rows the same way on both sides"
                )
            for x, y in zip(a.rows, b.rows, strict=True):
                why = _row_difference(x, y, self.engine == "vLLM")
                if why:
                    return f"KV layout mismatch ({pair}): group {i} ({a.kind}): {why}"
        return None


def _row_difference(a: SlotRows, b: SlotRows, vllm: bool) -> str | None:
    """How two descriptions of a slot tensor's rows differ (here, on the peer), or None."""
    if a.segments != b.segments:
        return f"rows split as {a.segments} here but {b.segments} on the peer"
    if a.lines != b.lines:
        return f"{a.lines} lines (conv taps) here but {b.lines} on the peer"
    if a.row_bytes != b.row_bytes:
        hint = ": give both servers the same --block-size" if vllm else ""
        return (
            f"{a.row_bytes} bytes a row here but {b.row_bytes} on the peer (another block "
            f"size or dtype{hint})"
        )
    return None


def _shapes(rows) -> list[tuple]:
    """What must agree between two TP sizes' descriptions of a slot's tensors."""
    return [(r.segments, r.row_bytes, r.lines) for r in rows]
