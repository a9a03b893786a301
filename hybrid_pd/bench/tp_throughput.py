"""`bench tp`'s throughput half: prefill and decode tokens/s of one engine at TP 1 next to
TP 2 on the same checkpoint, each setup a fresh process (`python -m
hybrid_pd.bench.tp_throughput`, rank 0; at TP 2 it starts rank 1 with the product's
`workers.tp_ranks.RankGroup`), the setups alternating rep by rep."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: (name, TP size, torch threads per rank, environment): the same 2 cores either way.
SETUPS = (("tp1", 1, 2, {}), ("tp2", 2, 1, {}))
#: TP 2 with gloo's collectives instead of shared memory's (`bench tp --gloo-baseline`).
GLOO_SETUP = ("tp2_gloo", 2, 1, {"HYBRID_PD_TP_SHM": "0"})


def measure(
    path: Path,
    size: int,
    threads: int,
    batch_sizes: list[int],
    prompt_len: int,
    new_tokens: int,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One setup's run in a fresh process (`env`: added to this one's environment); its
    JSON (`_main`). RuntimeError when the process fails."""
    cmd = [
        sys.executable,
        "-m",
        "hybrid_pd.bench.tp_throughput",
        "--model",
        str(path),
        "--size",
        str(size),
        "--threads",
        str(threads),
        "--batch-sizes",
        ",".join(map(str, batch_sizes)),
        "--prompt-len",
        str(prompt_len),
        "--new-tokens",
        str(new_tokens),
    ]
    full_env = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env)
    if out.returncode != 0 or not out.stdout.strip():
        tail = out.stderr[-2000:]
        raise RuntimeError(f"TP {size} throughput run failed ({out.returncode}): {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(
    family: str,
    path: Path,
    batch_sizes: list[int],
    prompt_len: int,
    new_tokens: int,
    reps: int,
    setups: tuple = SETUPS,
) -> list[dict[str, Any]]:
    """TP 1 (2 threads) and TP 2 (1 thread per rank) (and any other `setups`), alternated
    `reps` times; one row per batch size: each rep's tokens/s, their medians, tp2 / tp1
    ratios (and tp2_gloo / tp1 where run), and whether the setups produced the same greedy
    tokens."""
    runs: dict[str, list[dict]] = {name: [] for name, _, _, _ in setups}
    for _ in range(reps):
        for name, size, threads, env in setups:
            runs[name].append(
                measure(path, size, threads, batch_sizes, prompt_len, new_tokens, env=env)
            )
    rows = []
    for i, bs in enumerate(batch_sizes):
        row: dict[str, Any] = {
            "family": family,
            "batch_size": bs,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
        }
        for name, size, threads, _ in setups:
            per_rep = [r["runs"][i] for r in runs[name]]
            row[name] = {
                "tp_size": size,
                "threads_per_rank": threads,
                "prefill_tokens_per_s": [r["prefill_tokens_per_s"] for r in per_rep],
                "decode_tokens_per_s": [r["decode_tokens_per_s"] for r in per_rep],
                "prefill_median": statistics.median(r["prefill_tokens_per_s"] for r in per_rep),
                "decode_median": statistics.median(r["decode_tokens_per_s"] for r in per_rep),
                "collectives": runs[name][0].get("collectives"),
            }
        one, two = row["tp1"], row["tp2"]
        row["prefill_ratio"] = round(two["prefill_median"] / one["prefill_median"], 3)
        row["decode_ratio"] = round(two["decode_median"] / one["decode_median"], 3)
        if "tp2_gloo" in row:
            gloo = row["tp2_gloo"]
            row["gloo_prefill_ratio"] = round(gloo["prefill_median"] / one["prefill_median"], 3)
            row["gloo_decode_ratio"] = round(gloo["decode_median"] / one["decode_median"], 3)
        tokens = {name: [r["runs"][i]["tokens"] for r in runs[name]] for name in runs}
        row["tokens_equal"] = all(t == tokens["tp1"][0] for ts in tokens.values() for t in ts)
        rows.append(row)
    return rows


def _timed_batch(engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Prefill time is the first step (the whole batch fits one step); decode tokens/s
    counts the tokens after the first."""
    from hybrid_pd.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    first = None
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if first is None:
            first = time.perf_counter()
    t1 = time.perf_counter()
    bs = len(prompts)
    return {
        "batch_size": bs,
        "prefill_tokens_per_s": round(bs * len(prompts[0]) / (first - t0), 1),
        "decode_tokens_per_s": round(bs * (new_tokens - 1) / max(1e-9, t1 - first), 1),
        "tokens": [done.get(str(i), []) for i in ids],
    }


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hybrid_pd.engine.engine import Engine, EngineConfig
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.malloc import tune_malloc
    from hybrid_pd.engine.threads import set_torch_threads
    from hybrid_pd.engine.tp.group import SINGLE
    from hybrid_pd.workers.tp_ranks import RankGroup

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    set_torch_threads(args.threads)
    tune_malloc()
    config = EngineConfig(
        kv_memory_bytes=256 * 2**20,
        max_num_batched_tokens=args.prompt_len * max(sizes),
        enable_prefix_caching=False,
    )
    ranks = (
        RankGroup(args.model, args.size, config, threads=args.threads) if args.size > 1 else None
    )
    group = ranks.group if ranks is not None else SINGLE
    collectives = "none" if group.size == 1 else "shm" if group.shm is not None else "gloo"
    engine = None
    try:
        model, hf_config, tok = load_model(Path(args.model), tp=group)
        engine = Engine(model, hf_config, config, tok, tp=group)
        gen = torch.Generator().manual_seed(0)
        # First forward passes (allocations, lazy init) at the largest shape, untimed.
        warm = torch.randint(3, 256, (args.prompt_len,), generator=gen).tolist()
        _timed_batch(engine, [warm] * max(sizes), 4)
        runs = []
        for bs in sizes:
            prompts = [
                torch.randint(3, 256, (args.prompt_len,), generator=gen).tolist() for _ in range(bs)
            ]
            runs.append(_timed_batch(engine, prompts, args.new_tokens))
    finally:
        if ranks is not None:
            ranks.close(engine)
    return {
        "tp_size": args.size,
        "threads": args.threads,
        "collectives": collectives,
        "runs": runs,
    }


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_pd.bench.tp_throughput")
    p.add_argument("--model", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--batch-sizes", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    args = p.parse_args(argv)
    from hybrid_pd.engine.heap import frozen_heap

    with frozen_heap():  # as in every engine process
        result = _run(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
