"""The physical pool: one byte tensor per worker, typed per-layer views into it.

    buffer: uint8 [num_blocks, page_size_bytes]        (block 0 is the null block)

    block b ─┬─ group g's layer 0 slot ─┬─ K [B, H, D] ─┬─ V [B, H, D]
             ├─ layer 1 slot ...        │  (attention)
             └─ unused padding          └─ state: conv [C, K-1] | ssm [...]  (state groups)

Consecutive block ids are adjacent in memory, so a run of block ids is one region for
transfers. A layer's view strides over whole pages: `view[b]` is that layer's part of
block b, for any group that owns the layer.

Decode steps on the CPU update each state layer's rows where they lie
(`state_views_in_place`: kernels indexed by block id). Elsewhere (another device, a dtype
the kernels do not take, a state spanning several blocks) held state rows apply: a decode
step gathers each state layer's rows (one per sequence) into one tensor, updates it and
scatters it back. With held rows on (`hold_rows_for`, which
the engine calls), `scatter_states` keeps the rows instead of writing them (up to a memory
budget), and the next `gather_states` of the same blocks in the same order gets them back:
a steady decode batch neither gathers nor scatters. Held rows are the only current copy of
those states, so they are written to their pages (`flush_rows`) before anything else can
see the pages: when the block allocator is about to free any of their blocks (before a
block can change owner or enter the prefix cache), before `read_state`, `write_state` and
`copy_blocks` touch them, before a gather of other rows for the same layer, and when the
engine hands a request's pages to a decode worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from hybrid_pd.kvcache.config import KVCacheConfig, state_tensor_offsets
from hybrid_pd.kvcache.specs import AttentionSpec, StateSpec, dtype_bytes

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def num_blocks_for_memory(config: KVCacheConfig, kv_memory_bytes: int) -> int:
    """Blocks (the null block included) that fit in `kv_memory_bytes`."""
    n = kv_memory_bytes // config.page_size_bytes
    if n < 2:
        raise ValueError(
            f"KV memory of {kv_memory_bytes} bytes holds fewer than 2 pages of "
            f"{config.page_size_bytes} bytes; raise --kv-memory"
        )
    return n


def _words(raw: torch.Tensor) -> torch.Tensor:
    """Rows of bytes (slots start and end on SLOT_ALIGN = 16 byte boundaries) seen as 16-byte
    elements, so indexed row copies move 16 bytes at a time instead of one: writes into
    indexed rows ran 3-4x faster on CPU than as int64 words (1.4-1.8 vs 0.4 ms for 8.8 MB).
    The elements are only copied, never computed on, so every bit pattern (a float64 NaN's
    included) arrives as it was; tests/kvcache/test_pool.py checks it."""
    return raw.view(torch.complex128)


def _same_ids(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _shares_storage(t: torch.Tensor, flat: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def _is_region(t: torch.Tensor, flat: torch.Tensor, off: int, dtype: str) -> bool:
    """Whether `t` [rows, *shape] is exactly the `dtype` view of bytes [off, off + n) of
    each row of `flat` (as `gather_states` hands them out)."""
    typed = torch_dtype(dtype)
    if t.dtype != typed or not _shares_storage(t, flat):
        return False
    if t.data_ptr() != flat.data_ptr() + off:
        return False
    # one row: its stride is not kept by views (unflatten gave [1, 1152, 3] a stride of
    # 3456 in a 276,000-byte row), and no other row is reached through it
    if len(t) > 1 and t.stride(0) * t.element_size() != flat.stride(0):
        return False
    return t[0].is_contiguous()


@dataclass
class _HeldRows:
    """A layer's rows that `scatter_states` kept instead of writing (see the module
    docstring): the newest states of these blocks, not yet on their pages."""

    block_ids: torch.Tensor  # [S, blocks_per_state], as scattered
    tensors: list[torch.Tensor]  # one [S, *shape] per state tensor, in the pool's dtypes
    flat: torch.Tensor | None  # states over several blocks: the rows' bytes, tensors view it
    nbytes: int

    @cached_property
    def ids(self) -> frozenset[int]:
        # only flush_rows(block_ids) asks, far less often than every step holds rows
        return frozenset(self.block_ids.flatten().tolist())


#: Default budget for held state rows: a quarter of the pool, at most this.
HELD_ROWS_MAX_BYTES = 1 << 30


class KVPool:
    """Owns the KV memory of one worker."""

    def __init__(
        self,
        config: KVCacheConfig,
        num_blocks: int,
        device: torch.device | str | None = None,
        held_rows_bytes: int | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """`buffer`: the pool's memory when someone else provides it (a tensor-parallel
        rank's pool in shared memory, `engine.tp.shared_pool`): uint8 [num_blocks,
        page_size_bytes], zeroed. Default: a new zeroed tensor on `device`."""
        self.config = config
        self.num_blocks = num_blocks
        if buffer is None:
            buffer = torch.zeros(
                (num_blocks, config.page_size_bytes), dtype=torch.uint8, device=device
            )
        elif tuple(buffer.shape) != (num_blocks, config.page_size_bytes):
            raise ValueError(f"pool buffer {tuple(buffer.shape)} does not fit the config")
        self.buffer = buffer
        if held_rows_bytes is None:
            held_rows_bytes = min(HELD_ROWS_MAX_BYTES, self.buffer.numel() // 4)
        self.held_rows_bytes = held_rows_bytes
        #: Whether decode steps may update state rows in their pages (`state_views_in_place`);
        #: False sends every step through gathered rows (and held rows, when on).
        self.rows_in_place = True
        self.in_place_updates = 0  # layer steps that took the pages' own rows
        self._held: dict[str, _HeldRows] = {}
        self._held_total = 0
        self._holding = False  # see hold_rows_for
        self.held_hits = 0  # gathers answered from held rows
        # Views never change (the buffer is fixed): build each once, layers ask every step.
        self._attention_views: dict[str, torch.Tensor] = {}
        self._state_views: dict[str, list[torch.Tensor]] = {}
        # the buffer the last `gather_states` of a layer (state over several blocks) copied
        # the states into: `scatter_states` writes it back as is when handed its own views
        self._gathered: dict[str, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def _slot(self, layer_name: str) -> tuple[torch.Tensor, int]:
        group = self.config.group_of(layer_name)
        name = self.config.shared_layers.get(layer_name, layer_name)
        off = group.slot_offset(name)
        return self.buffer[:, off : off + group.slot_bytes], group.blocks_per_state

    def attention_view(self, layer_name: str) -> torch.Tensor:
        """[num_blocks, 2 (K, V), block_size, kv_heads, head_dim] view of one layer's KV.

        The slot itself is head-major, [kv_heads, 2, block_size, head_dim]: a KV head's K
        and V for the block's tokens lie together, so a range of heads (what one rank of a
        tensor-parallel peer holds) is one contiguous piece of the slot."""
        view = self._attention_views.get(layer_name)
        if view is None:
            view = self._attention_views[layer_name] = self._make_attention_view(layer_name)
        return view

    def _make_attention_view(self, layer_name: str) -> torch.Tensor:
        spec = self.config.group_of(layer_name).spec
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"{layer_name} is not an attention layer")
        raw, _ = self._slot(layer_name)
        n = spec.page_bytes(self.config.block_size)
        typed = raw[:, :n].view(torch_dtype(spec.dtype))
        shape = (spec.num_kv_heads, 2, self.config.block_size, spec.head_dim)
        return typed.unflatten(1, shape).permute(0, 2, 3, 1, 4)

    def state_views(self, layer_name: str) -> list[torch.Tensor]:
        """One [num_blocks, *shape] view per state tensor of a layer whose state fits in one
        block (`blocks_per_state == 1`); index it with the request's state block id."""
        views = self._state_views.get(layer_name)
        if views is None:
            views = self._state_views[layer_name] = self._make_state_views(layer_name)
        return views

    def state_views_in_place(self, layer_name: str) -> list[torch.Tensor] | None:
        """`state_views` for a step that updates rows where they lie (kernels indexed by
        block id), after any rows held for the layer are written back; None where the
        layer's state spans several blocks (then `gather_states` / `scatter_states`)."""
        if not self.rows_in_place or self.config.group_of(layer_name).blocks_per_state != 1:
            return None
        if layer_name in self._held:
            self._write_back(layer_name)
        self.in_place_updates += 1
        return self.state_views(layer_name)

    def _make_state_views(self, layer_name: str) -> list[torch.Tensor]:
        spec = self.config.group_of(layer_name).spec
        if not isinstance(spec, StateSpec):
            raise TypeError(f"{layer_name} is not a state layer")
        raw, span = self._slot(layer_name)
        if span != 1:
            raise ValueError(f"{layer_name}'s state spans {span} blocks; use read_state")
        return self._flat_views(layer_name, raw)

    def read_state(self, layer_name: str, block_ids: list[int]) -> list[torch.Tensor]:
        """A contiguous copy of one request's state gathered from its state blocks."""
        spec = self.config.group_of(layer_name).spec
        assert isinstance(spec, StateSpec)
        raw, span = self._slot(layer_name)
        if len(block_ids) != span:
            raise ValueError(f"{layer_name} needs {span} state blocks, got {len(block_ids)}")
        self.flush_rows(block_ids)
        idx = torch.tensor(block_ids, device=raw.device)
        flat = raw.index_select(0, idx).reshape(-1)
        offsets, _ = state_tensor_offsets(spec)
        out = []
        for off, shape, dtype in zip(offsets, spec.shapes, spec.dtypes, strict=True):
            n = math.prod(shape) * dtype_bytes(dtype)
            out.append(flat[off : off + n].view(torch_dtype(dtype)).view(shape))
        return out

    def write_state(self, layer_name: str, block_ids: list[int], tensors: list[torch.Tensor]):
        """Scatter a request's state (as returned by `read_state`) back into its blocks."""
        spec = self.config.group_of(layer_name).spec
        assert isinstance(spec, StateSpec)
        raw, span = self._slot(layer_name)
        if len(block_ids) != span:
            raise ValueError(f"{layer_name} needs {span} state blocks, got {len(block_ids)}")
        for t, shape in zip(tensors, spec.shapes, strict=True):
            if t.numel() != math.prod(shape):  # would spill into the next tensor or shard
                raise ValueError(
                    f"{layer_name}: state tensor of shape {shape} expected, got {tuple(t.shape)}"
                )
        offsets, _ = state_tensor_offsets(spec)
        flat = torch.zeros(span * raw.shape[1], dtype=torch.uint8, device=raw.device)
        for off, t, dtype in zip(offsets, tensors, spec.dtypes, strict=True):
            data = t.to(torch_dtype(dtype)).contiguous().reshape(-1).view(torch.uint8)
            flat[off : off + data.numel()] = data
        self.flush_rows(block_ids)
        idx = torch.tensor(block_ids, device=raw.device)
        _words(raw)[idx] = _words(flat.view(span, raw.shape[1]))

    def gather_states(self, layer_name: str, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """The states of S requests at once: `block_ids` [S, blocks_per_state] (each row one
        request's state blocks, in order) -> one [S, *shape] copy per state tensor. With
        held rows on, rows held for exactly these blocks come back as they are (the caller
        updates them in place and hands them to `scatter_states`)."""
        raw, span = self._slot(layer_name)
        if block_ids.dim() != 2 or block_ids.shape[1] != span:
            raise ValueError(f"{layer_name} needs [S, {span}] state block ids")
        held = self._held.get(layer_name)
        if held is not None:
            if _same_ids(held.block_ids, block_ids):
                self.held_hits += 1
                if held.flat is not None:
                    self._gathered[layer_name] = held.flat
                return held.tensors
            self._write_back(layer_name)
        if span == 1:  # index_select: 2.4x faster than view[ids] (8 MiB of float32 rows, CPU)
            return [view.index_select(0, block_ids[:, 0]) for view in self.state_views(layer_name)]
        spec = self.config.group_of(layer_name).spec
        assert isinstance(spec, StateSpec)
        # one request's state is the concatenation of its blocks' slots (see read_state)
        # index_select of whole rows copies far faster than indexing single bytes
        flat = _words(raw).index_select(0, block_ids.flatten()).view(torch.uint8)
        flat = flat.view(len(block_ids), -1)
        self._gathered[layer_name] = flat
        return self._flat_views(layer_name, flat)

    def _flat_views(self, layer_name: str, flat: torch.Tensor) -> list[torch.Tensor]:
        spec = self.config.group_of(layer_name).spec
        offsets, _ = state_tensor_offsets(spec)
        out = []
        for off, shape, dtype in zip(offsets, spec.shapes, spec.dtypes, strict=True):
            n = math.prod(shape) * dtype_bytes(dtype)
            out.append(flat[:, off : off + n].view(torch_dtype(dtype)).unflatten(1, shape))
        return out

    def scatter_states(
        self, layer_name: str, block_ids: torch.Tensor, tensors: list[torch.Tensor]
    ) -> None:
        """Store S requests' states (as `gather_states` returns them) for their blocks: held
        (see the module docstring) or written to the pool. Held tensors must not change
        afterwards except through the next gather of the same rows."""
        raw, span = self._slot(layer_name)
        spec = self.config.group_of(layer_name).spec
        assert isinstance(spec, StateSpec)
        rows = block_ids.shape[0]
        if block_ids.dim() != 2 or block_ids.shape[1] != span:
            raise ValueError(f"{layer_name} needs [S, {span}] state block ids")
        for t, shape in zip(tensors, spec.shapes, strict=True):
            if tuple(t.shape) != (rows, *shape):
                raise ValueError(
                    f"{layer_name}: states of shape {(rows, *shape)} expected, got {tuple(t.shape)}"
                )
        if span == 1:
            stored = [
                t.to(view.dtype)
                for view, t in zip(self.state_views(layer_name), tensors, strict=True)
            ]
            if not self._hold(layer_name, block_ids, stored, None):
                self._write(layer_name, block_ids, stored, None)
            return
        offsets, _ = state_tensor_offsets(spec)
        width = span * raw.shape[1]
        flat = self._gathered.pop(layer_name, None)
        if (
            flat is None
            or flat.shape != (rows, width)
            or any(
                _shares_storage(t, flat) and not _is_region(t, flat, off, dtype)
                for off, t, dtype in zip(offsets, tensors, spec.dtypes, strict=True)
            )
        ):
            # every byte of `flat` is written below: the tensors, then zeros in the gaps
            # (alignment, padding), cheaper than zero-filling it all first
            flat = torch.empty(rows, width, dtype=torch.uint8, device=raw.device)
        end = 0
        for off, t, dtype in zip(offsets, tensors, spec.dtypes, strict=True):
            n = math.prod(t.shape[1:]) * dtype_bytes(dtype)
            flat[:, end:off] = 0
            if not _is_region(t, flat, off, dtype):  # the gathered views are already there
                region = flat[:, off : off + n].view(torch_dtype(dtype)).view(t.shape)
                region.copy_(t)
            end = off + n
        flat[:, end:width] = 0
        if not self._hold(layer_name, block_ids, None, flat):
            self._write(layer_name, block_ids, None, flat)

    def _write(self, layer_name, block_ids, tensors, flat) -> None:
        """Write rows' states into their blocks: per-tensor rows (one block per state) or
        the rows' bytes (several)."""
        if flat is None:  # index_copy_: 1.3x faster than view[ids] = t
            for view, t in zip(self.state_views(layer_name), tensors, strict=True):
                view.index_copy_(0, block_ids[:, 0], t)
            return
        raw, _ = self._slot(layer_name)
        _words(raw)[block_ids.flatten()] = _words(flat.view(-1, raw.shape[1]))

    # -- held state rows (see the module docstring) ----------------------------------------
    def hold_rows_for(self, allocator) -> None:
        """Turn held rows on. `allocator` (the BlockPool handing out this pool's blocks)
        then calls `flush_rows` with the blocks it is about to free, so held states reach
        their pages before a block can change owner."""
        allocator.before_free = self.flush_rows
        self._holding = True

    def flush_rows(self, block_ids=None) -> None:
        """Write held rows to the pool and drop them: those that include any of
        `block_ids`, or all. Call it before reading or writing state pages any other way
        than `gather_states` / `scatter_states`."""
        if not self._held:
            return
        if block_ids is None:
            names = list(self._held)
        else:
            touched = {int(b) for b in block_ids}
            names = [n for n, h in self._held.items() if not touched.isdisjoint(h.ids)]
        for name in names:
            self._write_back(name)

    @property
    def held_rows_total(self) -> int:
        """Bytes of states held now (pages not yet written)."""
        return self._held_total

    def _write_back(self, layer_name: str) -> None:
        held = self._held.pop(layer_name)
        self._held_total -= held.nbytes
        # Held rows are made in the engine's step (inference mode), but blocks are also
        # freed outside it (an abort, a lease released): writing from inference tensors into
        # views made there is refused outside inference mode.
        with torch.inference_mode():
            self._write(layer_name, held.block_ids, held.tensors, held.flat)

    def _hold(self, layer_name, block_ids, tensors, flat) -> bool:
        """Keep the rows instead of writing them, if held rows are on and they fit the
        budget. Rows held for other blocks are written first (they may share blocks)."""
        if not self._holding:
            return False
        old = self._held.get(layer_name)
        if old is not None:
            if _same_ids(old.block_ids, block_ids):
                del self._held[layer_name]  # replaced: these are newer
                self._held_total -= old.nbytes
            else:
                self._write_back(layer_name)
        if flat is not None:
            nbytes = flat.numel()
            tensors = self._flat_views(layer_name, flat)
        else:
            nbytes = sum(t.nbytes for t in tensors)
        if self._held_total + nbytes > self.held_rows_bytes:
            return False
        self._held[layer_name] = _HeldRows(block_ids.clone(), tensors, flat, nbytes)
        self._held_total += nbytes
        return True

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst (state snapshots taken from the prefix cache)."""
        if not pairs:
            return
        self.flush_rows([b for pair in pairs for b in pair])
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.buffer.index_copy_(0, dst, self.buffer.index_select(0, src))

    def region(self, first_block: int, num_blocks: int) -> torch.Tensor:
        """The contiguous bytes of blocks [first_block, first_block + num_blocks)."""
        return self.buffer[first_block : first_block + num_blocks]
