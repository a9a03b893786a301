"""vLLM's KV cache config as our `KVLayout`: what two vLLM servers must share."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hybrid_pd.connector.layout import VLLM_PREFIX, GroupGeometry, KVLayout
from hybrid_pd.connector.vllm.tp_rows import vllm_group_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def layout_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVLayout:
    """What two vLLM workers must share to exchange blocks (both halves derive it alike)."""
    groups = kv_cache_config.transfer_groups
    model = vllm_config.model_config
    rows = vllm_group_rows(vllm_config, kv_cache_config)
    return KVLayout(
        block_size=groups[0].kv_cache_spec.block_size,
        page_size_bytes=groups[0].kv_cache_spec.page_size_bytes,
        groups=tuple(
            GroupGeometry(
                kind=type(g.kv_cache_spec).__name__,
                spec=repr(g.kv_cache_spec),
                num_layers=len(g.layer_names),
                slot_bytes=g.kv_cache_spec.page_size_bytes,
                blocks_per_state=1,
                rows=r,
            )
            for g, r in zip(groups, rows, strict=True)
        ),
        model=f"{VLLM_PREFIX}{os.path.basename(str(model.model).rstrip('/'))}:"
        f"{','.join(model.hf_config.architectures or [])}",
        # a rank's caches (vLLM's specs are per rank): equal sizes pair rank to rank,
        # others map each decode rank's rows to the prefill ranks holding them (`rows`)
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
    )
