"""Which of a request's blocks decode needs: every full-attention block, the last window
of a sliding-window group, the running state page of a Mamba/GDN group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0


class BlockClipper:
    """Which of a request's blocks decode needs, per transfer group."""

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.config = kv_cache_config
        self.window_blocks: list[int] = []  # sliding window: blocks kept (0: all)
        self.scratch: list[int | None] = []  # state groups: trailing speculative slots
        for g in kv_cache_config.transfer_groups:
            spec = g.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                # +1: the window need not start on a block boundary.
                self.window_blocks.append(-(-spec.sliding_window // spec.block_size) + 1)
            else:
                self.window_blocks.append(0)
            self.scratch.append(
                spec.num_speculative_blocks if isinstance(spec, MambaSpec) else None
            )

    def clip(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """`block_ids`: one list per KV cache group (vLLM's order, null blocks included)."""
        out = []
        for g, ids in enumerate(self.config.select_transfer_block_ids(list(block_ids))):
            ids = list(ids)
            if self.scratch[g] is not None:
                if n := min(self.scratch[g], len(ids) - 1):
                    ids = ids[:-n]
                ids = ids[-1:]  # the running state
            elif self.window_blocks[g]:
                ids = ids[-self.window_blocks[g] :]
            out.append(tuple(b for b in ids if b != NULL_BLOCK))
        return tuple(out)
