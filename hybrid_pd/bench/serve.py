"""`hybrid-pd bench serve`: load on the proxy, P/D (one prefill + one decode worker) next to
aggregated (one worker of role `both`), streaming completions at several concurrency levels."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hybrid_pd.bench.completions import _prompt, level_columns, print_rows, run_level
from hybrid_pd.bench.service import (
    NEVER,
    BenchModel,
    _routes,
    _start_workers,
    start_proxy,
    worker_kv_check,
)

SETUPS = ("pd", "aggregated")


def add_serve_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("serve", help="load on the proxy: P/D next to one aggregated worker")
    s.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    s.add_argument("--requests", type=int, default=32, help="requests per level")
    s.add_argument(
        "--max-seconds",
        type=float,
        default=120.0,
        help="load budget of the run (half per setup): no request starts after it",
    )
    s.add_argument("--prompt-len", type=int, default=256)
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--model", default="tiny")
    s.add_argument("--kv-memory", default="64MiB", help="KV memory of each worker")
    s.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    s.add_argument("--plot", default=None, help="write TTFT and throughput to this PNG")
    s.add_argument(
        "--peer",
        choices=["vllm"],
        default=None,
        help="instead of P/D: our aggregated worker next to vLLM's OpenAI server",
    )
    s.add_argument(
        "--peer-python",
        default=None,
        help="--peer vllm: the Python that has vLLM (default: $HYBRID_PD_VLLM_PYTHON)",
    )
    s.add_argument(
        "--schema",
        default=None,
        metavar="FILE",
        help="instead of P/D vs aggregated: P/D with and without this JSON schema (guided_json)",
    )
    s.add_argument("--reps", type=int, default=2, help="--peer, --schema: alternating repetitions")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_bench_serve)


def _run_setup(
    setup: str,
    m: BenchModel,
    worker_args: list[str],
    env: dict | None,
    levels: list[int],
    prompts: dict[int, list[list[int]]],
    warm: list[int],
    max_tokens: int,
    budget_s: float,
    progress: bool,
) -> dict:

    workers = _start_workers(["prefill", "decode"] if setup == "pd" else ["both"], worker_args, env)
    proxy = None
    try:
        # P/D: every prompt takes the prefill worker. Aggregated: its one worker is in both
        # pools but no prompt reaches min_prefill_tokens, so each runs wholly on it.
        proxy = start_proxy(
            m.name, m.path, workers[:1], workers[-1:],
            min_prefill_tokens=1 if setup == "pd" else NEVER,
        )  # fmt: skip
        # Warm-up (not measured): the first forward passes of a fresh process are slow.
        w = run_level(
            proxy.url,
            m.name,
            [warm],
            max_tokens,
            1,
            time.monotonic() + 600,
            f"{setup} warm-up",
            progress=False,
        )
        if w["errors"]:
            raise RuntimeError(f"{setup}: the warm-up request failed: {w['error_samples']}")
        deadline = time.monotonic() + budget_s
        rows = [
            run_level(
                proxy.url,
                m.name,
                prompts[c],
                max_tokens,
                c,
                deadline,
                f"{setup} c={c}",
                progress,
            )
            for c in levels
        ]
        used = budget_s - max(0.0, deadline - time.monotonic())
        routes = _routes(proxy.url)
        proxy.stop()
        proxy = None
        return {"rows": rows, "routes": routes, "workers": worker_kv_check(workers), "used_s": used}
    finally:
        if proxy is not None:
            proxy.stop()
        for w in workers:
            w.stop()


def bench_serve(
    model: str = "tiny",
    concurrency: list[int] | tuple[int, ...] = (1, 4, 16),
    requests: int = 32,
    max_seconds: float = 120.0,
    prompt_len: int = 256,
    max_tokens: int = 32,
    plot: str | None = None,
    kv_memory: str = "64MiB",
    threads: int = 1,
    env: dict[str, str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:

    m = BenchModel.resolve(model)
    vocab = m.vocab
    levels = list(concurrency)
    prompts = {c: [_prompt(f"{c}-{i}", prompt_len, vocab) for i in range(requests)] for c in levels}
    args = m.worker_args(kv_memory, threads)
    result: dict[str, Any] = {
        "model": model,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "requests": requests,
        "max_seconds": max_seconds,
        "setups": {},
        "routes": {},
        "workers": {},
    }
    spent = 0.0
    for k, setup in enumerate(SETUPS):
        budget = max_seconds / 2 if k == 0 else max(0.0, max_seconds - spent)
        warm = _prompt(f"warmup-{setup}", prompt_len, vocab)
        out = _run_setup(setup, m, args, env, levels, prompts, warm, max_tokens, budget, progress)
        spent += out["used_s"]
        result["setups"][setup] = out["rows"]
        result["routes"][setup] = out["routes"]
        result["workers"][setup] = out["workers"]
    result["no_leaks"] = all(w["clean"] for ws in result["workers"].values() for w in ws)
    keys = ("output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50")
    result["ratios"] = [  # pd / aggregated; None where either side has no figure
        {
            "concurrency": a["concurrency"],
            **{k: round(a[k] / b[k], 3) if a[k] and b[k] else None for k in keys},
        }
        for a, b in zip(result["setups"]["pd"], result["setups"]["aggregated"], strict=True)
    ]
    result["plot"] = write_plot(result, plot) if plot else None
    return result


def write_plot(result: dict, path: str) -> str | None:
    """TTFT p50 and output tokens/s vs concurrency, both setups; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for setup, rows in result["setups"].items():
        xs = [r["concurrency"] for r in rows]
        ax1.plot(xs, [r["ttft_ms_p50"] for r in rows], marker="o", label=setup)
        ax2.plot(xs, [r["output_tokens_per_s"] for r in rows], marker="o", label=setup)
    for ax, title in ((ax1, "TTFT p50 (ms)"), (ax2, "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{result['model']}: prompt {result['prompt_len']}, {result['max_tokens']} output tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("bench serve needs httpx: pip install 'hybrid-pd[test]'", file=sys.stderr)
        return 2
    load = _load_args(args)
    if args.peer:
        from hybrid_pd.bench.serve_peer import cmd_bench_serve_peer

        return cmd_bench_serve_peer(args, load)
    if args.schema:
        from hybrid_pd.bench.serve_schema import bench_serve_schema, print_schema_result

        try:
            schema = json.loads(Path(args.schema).read_text())
        except (OSError, ValueError) as e:
            print(f"--schema: {e}", file=sys.stderr)
            return 2
        result = bench_serve_schema(schema, reps=args.reps, **load)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_schema_result(result)
        return 0 if result["no_leaks"] and not result["errors"] else 1
    result = bench_serve(plot=args.plot, **load)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        cols = level_columns("output_tokens_per_request")
        for setup, rows in result["setups"].items():
            print_rows(f"{setup} (routes {result['routes'][setup]}):", cols, rows)
        for r in result["ratios"]:
            print(
                f"pd/aggregated at c={r['concurrency']}: throughput "
                f"{r['output_tokens_per_s']}, TTFT p50 {r['ttft_ms_p50']}"
            )
        print("no leaked KV blocks" if result["no_leaks"] else f"LEAKS: {result['workers']}")
    return 0 if result["no_leaks"] else 1


def _load_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that shape the load, as keywords of `bench_serve` / `bench_serve_peer`."""
    return {
        "model": args.model,
        "concurrency": [int(x) for x in args.concurrency.split(",") if x.strip()],
        "requests": args.requests,
        "max_seconds": args.max_seconds,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "kv_memory": args.kv_memory,
        "threads": args.threads,
    }
