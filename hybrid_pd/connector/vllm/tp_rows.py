"""Which rows of vLLM's per-layer caches each tensor-parallel rank holds.

vLLM views each layer's cache as one tensor indexed by block id first, a block one page
of its group apart. One block of one rank's cache, as vLLM's CPU build lays it out:

    attention   [kv_heads, block_size, K | V]     rows: KV heads (replicated when fewer
                                                   heads than ranks)
    state layer one page of bytes, its tensors packed one after another
                                                   (MambaBase.bind_kv_cache unpacks them):
      Mamba2    conv [kernel - 1, x | B | C] ("SD"), then SSM [heads, head_dim, state]
                conv rows: channels, x by head, B and C by group (n_groups < TP: every
                rank holds its heads' group); SSM rows: heads
      GDN       conv [kernel - 1, q | k | v], then state [v_heads, v_dim, k_dim]
                conv rows: q and k by key head, v by value head; state rows: value heads
      Mamba1    conv over the inner channels, then SSM [inner, state]

(with VLLM_SSM_CONV_STATE_LAYOUT=DS a conv state is [channels, kernel - 1]: one line).

Each tensor is described as `kvcache.tp_layout.SlotRows` at its offset in the block,
with the model's rows at TP 1 (from the checkpoint's config, `kvcache.hf_configs`), so
the pieces a decode rank needs from each prefill rank come from `tensor_pieces`, the
same mapping our engine's TP groups use. A description is checked against vLLM's own
per-rank shapes here and against the cache tensors at `register_kv_caches`
(`rank_plan.check_views`); what does not match is left undescribed, and servers of
different TP sizes are then refused by name.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from hybrid_pd.kvcache.specs import AttentionSpec, LayerSpec, ModelCacheSpec, StateSpec
from hybrid_pd.kvcache.tp_layout import SlotRows, TPLayoutError

logger = logging.getLogger(__name__)

#: vLLM's Mamba backends (MambaAttentionBackendEnum names) as our state kinds.
MAMBA_TYPES = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn"}

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def attention_rows(
    full: AttentionSpec, rank_heads: int, row_bytes: int, tp_size: int
) -> tuple[SlotRows, ...]:
    """A head-major attention block: one row per KV head (`row_bytes`: its K and V for
    every token of the block). Raises TPLayoutError when vLLM's heads per rank are not
    the split of the model's `full.num_kv_heads`."""
    rows = SlotRows(0, row_bytes, ((full.num_kv_heads, 1, True),))
    _expect(rows.rank_rows(tp_size), rank_heads, "KV heads per rank")
    return (rows,)


def state_rows(
    full: StateSpec,
    shapes: Sequence[Sequence[int]],
    dtype_bytes: Sequence[int],
    tp_size: int,
    conv_dim_first: bool = False,
) -> tuple[SlotRows, ...]:
    """A state layer's tensors, vLLM's per-rank `shapes` (one block each; the first is
    the conv state, token-major unless `conv_dim_first`), packed one after another in
    the layer's page as vLLM's Mamba layers unpack it. Raises TPLayoutError when they
    are not the split of `full`'s rows."""
    if not full.row_splits or len(shapes) != len(full.row_splits):
        raise TPLayoutError(
            f"{len(shapes)} state tensors, {len(full.row_splits)} described for {full.mamba_type}"
        )
    out, offset = [], 0
    for i, (shape, es, segs) in enumerate(zip(shapes, dtype_bytes, full.row_splits, strict=True)):
        shape = tuple(int(d) for d in shape)
        if i == 0 and not conv_dim_first:  # [taps, channels]
            if len(shape) != 2:
                raise TPLayoutError(f"conv state of shape {shape}")
            rows = SlotRows(offset, es, tuple(segs), lines=shape[0])
            _expect(rows.rank_rows(tp_size), shape[1], "conv channels per rank")
        else:  # [rows, ...]
            rows = SlotRows(offset, math.prod(shape[1:]) * es, tuple(segs))
            _expect(rows.rank_rows(tp_size), shape[0], f"rows of state tensor {i} per rank")
        out.append(rows)
        offset += rows.rank_bytes(tp_size)
    return tuple(out)


def _expect(described: int, actual: int, what: str) -> None:
    if described != actual:
        raise TPLayoutError(f"{what}: vLLM holds {actual}, the model's split gives {described}")


def full_spec_of(model: ModelCacheSpec, layer_name: str, state: str | None) -> LayerSpec:
    """Our TP-1 spec of vLLM's layer `layer_name` (matched by layer index and kind:
    `state` is the state kind, None for attention). Raises TPLayoutError when there is
    not exactly one."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise TPLayoutError(f"no layer index in {layer_name!r}")
    prefix = f"model.layers.{m.group(1)}"
    found = [
        s
        for name, s in model.layers.items()
        if (name == prefix or name.startswith(prefix + "."))
        and (
            isinstance(s, StateSpec) and s.mamba_type == state
            if state
            else isinstance(s, AttentionSpec)
        )
    ]
    if len(found) != 1:
        raise TPLayoutError(f"{len(found)} matching layers for {layer_name!r}")
    return found[0]


def vllm_group_rows(vllm_config: Any, kv_cache_config: Any) -> list[tuple[SlotRows, ...]]:
    """Per KV cache group (vLLM's transfer groups, in order), its layers' tensors as
    this server's ranks hold them; () for a group that is not described (a reason is
    logged once). Same on the scheduler and the worker side (config only)."""
    from hybrid_pd.kvcache.hf_configs import cache_spec_from_config

    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    groups = kv_cache_config.transfer_groups
    try:
        model = cache_spec_from_config(vllm_config.model_config.hf_config.to_dict())
    except (ValueError, KeyError, TypeError) as e:
        logger.info("hybrid-pd connector: cache rows not described (%s)", e)
        return [()] * len(groups)
    out = []
    for i, g in enumerate(groups):
        try:
            out.append(_rows_of(model, g.layer_names[0], g.kv_cache_spec, tp))
        except TPLayoutError as e:
            logger.info("hybrid-pd connector: group %d rows not described: %s", i, e)
            out.append(())
    return out


def _rows_of(model: ModelCacheSpec, layer: str, spec: Any, tp: int) -> tuple[SlotRows, ...]:
    """One vLLM group's rows from its first layer and vLLM's (per-rank) spec."""
    import torch

    if hasattr(spec, "mamba_type") and hasattr(spec, "shapes"):
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        kind = MAMBA_TYPES.get(getattr(spec.mamba_type, "name", ""))
        if kind is None:
            raise TPLayoutError(f"state layers of type {spec.mamba_type} are not described")
        full = full_spec_of(model, layer, kind)
        sizes = [torch.empty((), dtype=d).element_size() for d in spec.dtypes]
        return state_rows(full, spec.shapes, sizes, tp, is_conv_state_dim_first())
    if hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size"):
        if getattr(spec, "num_head_slots", None) is not None or getattr(
            spec, "state_content_bytes", None
        ):
            raise TPLayoutError("packed attention pages are not described")
        full = full_spec_of(model, layer, None)
        heads = int(spec.num_kv_heads)
        return attention_rows(full, heads, spec.unpadded_page_size_bytes // heads, tp)
    raise TPLayoutError(f"{type(spec).__name__} rows are not described")
