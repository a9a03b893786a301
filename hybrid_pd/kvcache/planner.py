"""Capacity planner: what the hybrid manager buys for a model, next to HMA off and vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_pd.kvcache.config import KVCacheConfig
from hybrid_pd.kvcache.grouping import HMAOffError, plan_groups, vllm_style_config
from hybrid_pd.kvcache.specs import ModelCacheSpec


@dataclass(frozen=True)
class PlanOptions:
    kv_memory_bytes: int = 40 * 2**30
    block_size: int | None = None
    max_block_size: int = 64
    block_align: int = 1
    max_model_len: int | None = None
    dtype: str | None = None


def describe(config: KVCacheConfig, max_model_len: int, kv_memory: int) -> dict[str, Any]:
    """The planner fields of one grouping."""
    per_request = config.bytes_per_request(max_model_len)
    num_blocks = kv_memory // config.page_size_bytes
    blocks_per_request = config.blocks_per_request(max_model_len)
    usable = max(0, num_blocks - 1)  # the null block
    return {
        "block_size": config.block_size,
        "page_size_bytes": config.page_size_bytes,
        "num_groups": len(config.groups),
        "groups": [
            {
                "group_id": g.group_id,
                "type": g.kind,
                "num_layers": len(g.layer_names),
                "layers": list(g.layer_names),
                "padding_layers": config.padding_slots(g),
                "block_size": config.block_size,
                "slot_bytes": g.slot_bytes,
                "blocks_per_state": g.blocks_per_state,
            }
            for g in config.groups
        ],
        "strategy": config.strategy,
        "padding_waste": round(config.padding_waste(max_model_len), 6),
        "padding_bytes_per_request": config.padding_bytes(max_model_len),
        "bytes_per_request": per_request,
        "blocks_per_request": blocks_per_request,
        "num_blocks": num_blocks,
        "max_concurrent_requests": usable // blocks_per_request if blocks_per_request else 0,
    }


def plan_report(model: ModelCacheSpec, opts: PlanOptions) -> dict[str, Any]:
    """Planner output: HMA on (ours), HMA off, and vLLM's documented heuristic."""
    if opts.dtype:
        model = model.with_dtype(opts.dtype)
    max_len = opts.max_model_len or model.max_model_len or 4096
    kw = dict(
        block_size=opts.block_size,
        max_block_size=opts.max_block_size,
        block_align=opts.block_align,
        ref_len=max_len,
    )
    ours = plan_groups(model, **kw)
    report: dict[str, Any] = {
        "architecture": model.architecture,
        "max_model_len": max_len,
        "kv_memory_bytes": opts.kv_memory_bytes,
        "num_cache_layers": len(model.layers),
        "num_shared_layers": len(model.shared),
        **describe(ours, max_len, opts.kv_memory_bytes),
    }
    try:
        report["no_hma"] = describe(
            plan_groups(model, hma=False, **kw), max_len, opts.kv_memory_bytes
        )
    except HMAOffError as e:
        report["no_hma"] = {"error": str(e)}
    vllm = vllm_style_config(model)
    report["vllm_style"] = describe(vllm, max_len, opts.kv_memory_bytes)
    return report
