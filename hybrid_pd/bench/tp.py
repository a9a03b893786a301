"""`hybrid-pd bench tp`: tensor parallelism on small random checkpoints it builds itself
(`bench.checkpoints`, in a temporary folder).

1. Hand-offs between TP sizes (`bench.tp_pairs`): for each family and each P-D pair, a
   prefill worker at TP P and a decode worker at TP D; greedy tokens against one TP-1
   engine, the bytes each decode rank received against the least it needs, messages,
   hand-off time, recomputation and blocks left behind.
2. Engine throughput (`bench.tp_throughput`): TP 1 on 2 threads next to TP 2 on 1 thread
   per rank, alternated rep by rep, prefill and decode tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_FAMILIES = "qwen3_5,granite,gemma3,jamba"
DEFAULT_PAIRS = "1-1,1-2,2-1,2-2"


def add_tp_parser(bsub: argparse._SubParsersAction) -> None:
    t = bsub.add_parser(
        "tp",
        help="P/D between tensor-parallel sizes (exactness, bytes per rank) and TP 1 vs 2 speed",
        description="Builds small random checkpoints (families: qwen3_5, granite, gemma3, "
        "jamba, falcon_h1, gpt_oss), runs prompts through prefill/decode worker pairs of "
        "the given TP sizes, compares tokens with one TP-1 engine and each decode rank's "
        "bytes with the least it needs, then times one engine at TP 1 (2 threads) next to "
        "TP 2 (1 thread per rank).",
    )
    t.add_argument("--families", default=DEFAULT_FAMILIES, help="comma-separated")
    t.add_argument("--pairs", default=DEFAULT_PAIRS, help="PREFILL-DECODE TP sizes")
    t.add_argument("--lengths", default="16,100,300", help="prompt lengths of the pairs")
    t.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per pair request")
    t.add_argument("--hidden", type=int, default=256, help="hidden size of the pairs' models")
    t.add_argument(
        "--throughput-families", default="qwen3_5,granite", help="comma-separated; '' skips"
    )
    t.add_argument("--throughput-hidden", type=int, default=512)
    t.add_argument(
        "--throughput-models",
        default="",
        help="comma-separated full-size real shapes (as `bench engine --model`, e.g. "
        "granite-4.0-h-350m-like) also timed at TP 1 vs 2",
    )
    t.add_argument("--batch-sizes", default="1,8")
    t.add_argument("--prompt-len", type=int, default=128)
    t.add_argument("--decode-tokens", type=int, default=32)
    t.add_argument("--reps", type=int, default=2, help="alternating throughput repetitions")
    t.add_argument(
        "--gloo-baseline",
        action="store_true",
        help="also TP 2 with gloo's collectives instead of shared memory's (tp2_gloo)",
    )
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_cmd_bench_tp)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def bench_tp(
    families: list[str],
    pairs: list[tuple[int, int]],
    *,
    lengths: tuple[int, ...] = (16, 100, 300),
    new_tokens: int = 16,
    hidden: int = 256,
    throughput_families: list[str] = (),
    throughput_hidden: int = 512,
    throughput_models: list[str] = (),
    batch_sizes: list[int] = (1, 8),
    prompt_len: int = 128,
    decode_tokens: int = 32,
    reps: int = 2,
    gloo_baseline: bool = False,
    progress=None,
) -> dict[str, Any]:
    """Both halves; {"pairs": [...], "throughput": [...], "meta": {...}}. The checkpoints
    live in a temporary folder removed at the end; every worker and rank process started
    is stopped however the run ends."""
    from hybrid_pd.bench import checkpoints
    from hybrid_pd.bench.real_shapes import REAL_SHAPES, ensure_real_shape
    from hybrid_pd.bench.tp_pairs import run_family
    from hybrid_pd.bench.tp_throughput import GLOO_SETUP, SETUPS, compare

    setups = (*SETUPS, GLOO_SETUP) if gloo_baseline else SETUPS

    for name in [*families, *throughput_families]:
        if name not in checkpoints.FAMILIES:
            raise ValueError(f"unknown family {name!r}; known: {', '.join(checkpoints.FAMILIES)}")
    for name in throughput_models:
        if name not in REAL_SHAPES:
            raise ValueError(f"unknown real shape {name!r}; known: {', '.join(REAL_SHAPES)}")
    t0 = time.perf_counter()
    load_start = _loadavg()
    rows: list[dict] = []
    throughput: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hybrid-pd-bench-tp-") as tmp:
        root = Path(tmp)
        for family in families:
            path = checkpoints.build(family, root, hidden)
            rows += run_family(family, path, pairs, lengths, new_tokens, progress)
        for family in throughput_families:
            path = checkpoints.build(family, root, throughput_hidden)
            throughput += compare(
                family, path, list(batch_sizes), prompt_len, decode_tokens, reps, setups
            )
        for name in throughput_models:  # written once into the engine's cache folder
            throughput += compare(
                name,
                ensure_real_shape(name),
                list(batch_sizes),
                prompt_len,
                decode_tokens,
                reps,
                setups,
            )
    meta = {
        "families": {f: checkpoints.DESCRIPTIONS[f] for f in families},
        "hidden": hidden,
        "lengths": list(lengths),
        "new_tokens": new_tokens,
        "pair_worker_threads": 1,
        "throughput_hidden": throughput_hidden,
        "throughput_models": list(throughput_models),
        "throughput_setups": [
            {"name": n, "tp_size": s, "threads_per_rank": t, "env": e} for n, s, t, e in setups
        ],
        "reps": reps,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "seconds": round(time.perf_counter() - t0, 1),
        # Other work on the CPUs skews the timings (TP 1's 2 threads most of all).
        "loadavg_start": load_start,
        "loadavg_end": _loadavg(),
        "all_exact": all(r["exact"] for r in rows),
        "all_min_bytes": all(r["bytes_by_rank"] == r["min_bytes_by_rank"] for r in rows),
        "all_clean": all(r["clean"] for r in rows),
        "any_recomputed": any(r["recomputed"] for r in rows),
    }
    return {"pairs": rows, "throughput": throughput, "meta": meta}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def summary(result: dict[str, Any]) -> str:
    """The human table of a `bench_tp` result."""
    lines = [
        f"{'family':<10} {'pair':<5} {'exact':<5} {'bytes by decode rank':<28} "
        f"{'min (KiB)':<22} {'msgs':>5} {'handoff ms':>10} {'recomp':<6} leaked p/d  distinct"
    ]
    for r in result["pairs"]:
        kib = "/".join(f"{b / 1024:.1f}" for b in r["bytes_by_rank"])
        need = "/".join(f"{b / 1024:.1f}" for b in r["min_bytes_by_rank"])
        leaked = r["leaked_blocks"]
        lines.append(
            f"{r['family']:<10} {r['pair']:<5} {r['exact']!s:<5} {kib + ' KiB':<28} "
            f"{need:<22} {r['messages']:>5.1f} {r['handoff_ms']:>10.2f} "
            f"{r['recomputed']!s:<6} {leaked.get('prefill')}/{leaked.get('decode')}"
            f"{'':7}{r['reference_distinct_tokens']}/{r['reference_tokens']}"
        )
    if result["throughput"]:
        lines.append("")
        lines.append(
            f"{'family':<24} {'batch':>5}  {'prefill tok/s tp1 -> tp2':<28} "
            f"{'decode tok/s tp1 -> tp2':<28} same tokens"
        )
    for r in result["throughput"]:
        one, two = r["tp1"], r["tp2"]
        pre = f"{one['prefill_median']:.0f} -> {two['prefill_median']:.0f} ({r['prefill_ratio']}x)"
        dec = f"{one['decode_median']:.0f} -> {two['decode_median']:.0f} ({r['decode_ratio']}x)"
        same = r["tokens_equal"]
        lines.append(f"{r['family']:<24} {r['batch_size']:>5}  {pre:<28} {dec:<28} {same}")
        if "tp2_gloo" in r:
            g = r["tp2_gloo"]
            pre = f"  gloo: {g['prefill_median']:.0f} ({r['gloo_prefill_ratio']}x)"
            dec = f"{g['decode_median']:.0f} ({r['gloo_decode_ratio']}x)"
            lines.append(f"{'':<24} {'':>5}  {pre:<28} {dec:<28}")
    m = result["meta"]
    lines.append(
        f"\nall exact {m['all_exact']}, bytes = minimum {m['all_min_bytes']}, clean "
        f"{m['all_clean']}, recomputed {m['any_recomputed']}; {m['seconds']} s, load average "
        f"{m.get('loadavg_start')} -> {m.get('loadavg_end')}"
    )
    return "\n".join(lines)


def _cmd_bench_tp(args: argparse.Namespace) -> int:
    from hybrid_pd.bench.tp_pairs import parse_pairs

    try:
        pairs = parse_pairs(args.pairs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")

    def progress(row: dict) -> None:
        print(
            f"[bench tp] {row['family']} {row['pair']}: exact {row['exact']}, "
            f"bytes_by_rank {row['bytes_by_rank']} (min {row['min_bytes_by_rank']})",
            file=sys.stderr,
            flush=True,
        )

    try:
        result = bench_tp(
            _names(args.families),
            pairs,
            lengths=tuple(_ints(args.lengths)),
            new_tokens=args.new_tokens,
            hidden=args.hidden,
            throughput_families=_names(args.throughput_families),
            throughput_hidden=args.throughput_hidden,
            throughput_models=_names(args.throughput_models),
            batch_sizes=_ints(args.batch_sizes),
            prompt_len=args.prompt_len,
            decode_tokens=args.decode_tokens,
            reps=args.reps,
            gloo_baseline=args.gloo_baseline,
            progress=progress,
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(json.dumps(result, indent=2) if args.json else summary(result))
    ok = result["meta"]
    return 0 if ok["all_exact"] and ok["all_min_bytes"] and ok["all_clean"] else 1
