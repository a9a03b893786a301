"""`hybrid-pd bench kvcache`: the allocator's throughput on a reference model's layout
(prefix lookups, allocations, decode growth, frees; integrity checked at the end) and the
planner's table for every reference config (ours, vLLM-style, HMA off)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any


def add_kvcache_parser(bsub: argparse._SubParsersAction) -> None:
    k = bsub.add_parser("kvcache", help="allocator throughput and the planner table")
    k.add_argument("--requests", type=int, default=10_000)
    k.add_argument(
        "--model", default="gemma-3-27b-it", help="reference config to drive the allocator with"
    )
    k.add_argument("--kv-memory", default="16GiB")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_bench_kvcache)


def bench_kvcache(
    model_name: str, num_requests: int, kv_memory: int, seed: int = 0
) -> dict[str, Any]:
    """Drive the allocator with `num_requests` requests of mixed lengths.

    Each request: prefix lookup, prompt allocation, commit, 8 decode steps (one slot each),
    free. Up to 64 requests live at once; prompts share a few system prefixes so prefix
    hits happen. Integrity is checked at the end.
    """
    from hybrid_pd.kvcache.grouping import plan_groups
    from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
    from hybrid_pd.kvcache.manager import KVCacheManager
    from hybrid_pd.kvcache.pool import num_blocks_for_memory
    from hybrid_pd.kvcache.reference_configs import reference_config

    cfg = reference_config(model_name)
    if cfg is None:
        raise ValueError(f"unknown reference model {model_name!r}; see `hybrid-pd plan --list`")
    spec = cache_spec_from_config(cfg)
    config = plan_groups(spec, ref_len=8192)
    num_blocks = num_blocks_for_memory(config, kv_memory)
    mgr = KVCacheManager(config, num_blocks)
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1000) for _ in range(rng.choice((256, 512, 1024)))] for _ in range(4)
    ]
    live: list[tuple[str, list[int]]] = []
    calls = hits = hit_tokens = refused = 0
    decode_steps = 8
    t0 = time.perf_counter()
    for i in range(num_requests):
        body = [rng.randrange(1000) for _ in range(rng.choice((16, 100, 500, 2000, 6000)))]
        tokens = (rng.choice(prefixes) if rng.random() < 0.5 else []) + body
        rid = f"r{i}"
        while True:
            hit = mgr.find_prefix_hit(tokens)
            calls += 1
            if mgr.allocate_slots(rid, tokens, len(tokens) - hit.num_tokens, hit) is not None:
                break
            refused += 1
            if not live:
                raise RuntimeError("a single request does not fit; raise --kv-memory")
            mgr.free(live.pop(0)[0])
        hits += hit.num_tokens > 0
        hit_tokens += hit.num_tokens
        mgr.commit_computed(rid, len(tokens))
        for _ in range(decode_steps):
            tokens.append(rng.randrange(1000))
            calls += 1
            if mgr.allocate_slots(rid, tokens, 1) is None:
                refused += 1
                break
            mgr.commit_computed(rid, len(tokens))
        live.append((rid, tokens))
        if len(live) > 64:
            mgr.free(live.pop(0)[0])
    for rid, _ in live:
        mgr.free(rid)
    elapsed = time.perf_counter() - t0
    mgr.check_integrity()
    assert mgr.pool.num_free_blocks == num_blocks - 1, "blocks leaked"
    return {
        "model": model_name,
        "requests": num_requests,
        "num_blocks": num_blocks,
        "block_size": config.block_size,
        "num_groups": len(config.groups),
        "seconds": round(elapsed, 3),
        "requests_per_s": round(num_requests / elapsed, 1),
        "allocate_calls": calls,
        "allocate_calls_per_s": round(calls / elapsed, 1),
        "prefix_hit_requests": hits,
        "prefix_hit_tokens": hit_tokens,
        "refused_allocations": refused,
        "leaked_blocks": 0,
    }


def planner_table(max_model_len: int = 32768, kv_memory: int = 40 * 2**30) -> list[dict]:
    """Planner figures for every reference config: ours, vLLM-style, HMA off."""
    from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
    from hybrid_pd.kvcache.planner import PlanOptions, plan_report
    from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS, short_name

    rows = []
    for full, cfg in REFERENCE_CONFIGS.items():
        name = short_name(full)
        r = plan_report(
            cache_spec_from_config(cfg),
            PlanOptions(kv_memory_bytes=kv_memory, max_model_len=max_model_len),
        )
        row = {"model": name}
        for label, part in (
            ("hybrid_pd", r),
            ("vllm_style", r["vllm_style"]),
            ("no_hma", r["no_hma"]),
        ):
            if "error" in part:
                row[label] = {"error": part["error"]}
                continue
            row[label] = {
                k: part[k]
                for k in (
                    "block_size",
                    "num_groups",
                    "padding_waste",
                    "bytes_per_request",
                    "max_concurrent_requests",
                )
            }
        rows.append(row)
    return rows


def _cmd_bench_kvcache(args: argparse.Namespace) -> int:
    from hybrid_pd.api.sizes import parse_bytes

    result = {
        "allocator": bench_kvcache(
            args.model, args.requests, parse_bytes(args.kv_memory), args.seed
        ),
        "planner": planner_table(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        a = result["allocator"]
        print(
            f"allocator on {a['model']}: {a['requests']} requests in {a['seconds']} s "
            f"({a['requests_per_s']} req/s, {a['allocate_calls_per_s']} allocate calls/s), "
            f"{a['prefix_hit_requests']} prefix hits, no leaked block"
        )
        print(
            f"{'model':<24}{'block':>7}{'groups':>8}{'waste':>9}{'req @32k':>10}"
            f"{'vLLM block':>12}{'vLLM waste':>12}{'vLLM req':>10}{'HMA off req':>13}"
        )
        for row in result["planner"]:
            o, v, n = row["hybrid_pd"], row["vllm_style"], row["no_hma"]
            print(
                f"{row['model']:<24}{o['block_size']:>7}{o['num_groups']:>8}"
                f"{100 * o['padding_waste']:>8.3f}%{o['max_concurrent_requests']:>10}"
                f"{v['block_size']:>12}{100 * v['padding_waste']:>11.3f}%"
                f"{v['max_concurrent_requests']:>10}"
                f"{n.get('max_concurrent_requests', 'error'):>13}"
            )
    sys.stdout.flush()
    return 0
