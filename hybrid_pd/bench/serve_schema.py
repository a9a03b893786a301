"""`hybrid-pd bench serve --schema FILE`: what a JSON schema costs per token, through P/D.

One prefill and one decode worker behind the proxy (every prompt takes the prefill worker)
take the same load twice per level and repetition: plain streaming completions (greedy,
`ignore_eos`, `max_tokens`), and the same completions constrained by the schema
(`guided_json`; a constrained completion ends where its grammar does, at `max_tokens` at
the latest). The two alternate which goes first, for `reps` repetitions, each with prompts
of its own (a prompt seen before would measure the prefix cache). The grammar is compiled
before the measured requests (warm-up), as a server that has seen the schema has it cached.

Per level, the figures are medians over the repetitions, and:
- `schema_cost_per_token`: ITL p50 with the schema / without - 1 (0.05: each token after
  the first takes 5 % longer);
- `schema_cost_throughput`: 1 - output tokens/s with the schema / without (fewer tokens per
  constrained request weigh its prefill more: see `output_tokens_per_request`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from hybrid_pd.bench.completions import _prompt, level_columns, print_rows, run_level
from hybrid_pd.bench.serve_peer import _median_rows
from hybrid_pd.bench.service import (
    BenchModel,
    _routes,
    _start_workers,
    start_proxy,
    worker_kv_check,
)

VARIANTS = ("plain", "schema")


def _cost(with_schema: float | None, plain: float | None) -> float | None:
    return round(with_schema / plain - 1, 4) if with_schema and plain else None


def bench_serve_schema(
    schema: dict,
    model: str = "tiny",
    concurrency: list[int] | tuple[int, ...] = (1, 4, 16),
    requests: int = 32,
    max_seconds: float = 120.0,
    prompt_len: int = 256,
    max_tokens: int = 32,
    kv_memory: str = "64MiB",
    threads: int = 1,
    reps: int = 2,
    env: dict[str, str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Plain next to schema-constrained load on one P/D fleet (see the module's doc).
    `max_seconds`: the whole measured load; no request starts after it."""

    if reps < 1:
        raise ValueError("--reps must be at least 1")
    m = BenchModel.resolve(model)
    path, model_name, vocab = m.path, m.name, m.vocab
    levels = list(concurrency)
    extra = {"plain": None, "schema": {"guided_json": schema}}
    args = m.worker_args(kv_memory, threads)
    workers = _start_workers(["prefill", "decode"], args, env)
    proxy = None
    try:
        proxy = start_proxy(model_name, path, workers[:1], workers[1:], min_prefill_tokens=1)
        for v in VARIANTS:  # warm-up (not measured): first passes, the grammar's compile
            warm = [_prompt(f"warmup-{v}-{i}", prompt_len, vocab) for i in range(2)]
            w = run_level(
                proxy.url, model_name, warm, max_tokens, 1, time.monotonic() + 600,
                f"warm-up {v}", progress=False, extra=extra[v],
            )  # fmt: skip
            if w["errors"]:
                raise RuntimeError(f"the {v} warm-up failed: {w['error_samples']}")
        deadline = time.monotonic() + max_seconds
        reps_of: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
        for rep in range(reps):
            rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for c in levels:
                for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                    prompts = [
                        _prompt(f"{v}-{rep}-{c}-{i}", prompt_len, vocab) for i in range(requests)
                    ]
                    rows[v].append(
                        run_level(
                            proxy.url, model_name, prompts, max_tokens, c, deadline,
                            f"rep {rep} {v} c={c}", progress, extra=extra[v],
                        )
                    )  # fmt: skip
            for v in VARIANTS:
                reps_of[v].append(rows[v])
        routes = _routes(proxy.url)
        proxy.stop()
        proxy = None
        kv = worker_kv_check(workers)
    finally:
        if proxy is not None:
            proxy.stop()
        for w in workers:
            w.stop()
    setups = {v: _median_rows(reps_of[v]) for v in VARIANTS}
    for v in VARIANTS:
        for row in setups[v]:
            done = row.get("completed")
            row["output_tokens_per_request"] = (
                round(row["output_tokens"] / done, 2) if done and row.get("output_tokens") else None
            )
    costs = [
        {
            "concurrency": p["concurrency"],
            "schema_cost_per_token": _cost(s["itl_ms_p50"], p["itl_ms_p50"]),
            "schema_cost_itl_p90": _cost(s["itl_ms_p90"], p["itl_ms_p90"]),
            "schema_cost_throughput": (
                round(1 - s["output_tokens_per_s"] / p["output_tokens_per_s"], 4)
                if s["output_tokens_per_s"] and p["output_tokens_per_s"]
                else None
            ),
            "per_rep_cost_per_token": [
                _cost(rs[k]["itl_ms_p50"], rp[k]["itl_ms_p50"])
                for rp, rs in zip(reps_of["plain"], reps_of["schema"], strict=True)
            ],
        }
        for k, (p, s) in enumerate(zip(setups["plain"], setups["schema"], strict=True))
    ]
    per_token = [
        c["schema_cost_per_token"] for c in costs if c["schema_cost_per_token"] is not None
    ]
    return {
        "model": model,
        "setup": "pd",
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "requests": requests,
        "reps": reps,
        "max_seconds": max_seconds,
        "schema": schema,
        "setups": setups,
        "costs": costs,
        "schema_cost_per_token_median": (
            round(statistics.median(per_token), 4) if per_token else None
        ),
        "routes": routes,
        "workers": kv,
        "errors": sum(r["errors"] for rows in setups.values() for r in rows),
        "no_leaks": all(w["clean"] for w in kv),
    }


def print_schema_result(result: dict) -> None:
    """The human-readable table of `bench_serve_schema`'s result."""
    cols = level_columns("requests_per_s", "ttft_ms_p90", "e2e_ms_p50", "e2e_ms_p90")
    for v, rows in result["setups"].items():
        print_rows(f"{v} (medians over {result['reps']} alternating repetitions):", cols, rows)
    for c in result["costs"]:
        print(
            f"c={c['concurrency']}: schema cost per token (ITL p50) {c['schema_cost_per_token']}"
            f" (per repetition {c['per_rep_cost_per_token']}), throughput "
            f"{c['schema_cost_throughput']}"
        )
    print("no leaked KV blocks" if result["no_leaks"] else f"LEAKS: {result['workers']}")
