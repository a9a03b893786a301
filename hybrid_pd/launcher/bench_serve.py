"""`hybrid-pd bench serve`: load on the proxy, P/D (one prefill + one decode worker) next to
aggregated (one worker of role `both`), streaming completions at several concurrency levels."""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SETUPS = ("pd", "aggregated")
#: The aggregated proxy never disaggregates: no prompt is this long.
NEVER = 10**9


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
    s.add_argument("--reps", type=int, default=2, help="--peer: alternating repetitions")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_bench_serve)


def _pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def _ms(values: list[float], q: float) -> float | None:
    x = _pct(values, q)
    return None if x is None else round(1000 * x, 2)


def _prompt(seed: str, n: int, vocab: int | None) -> list[int]:
    """Distinct random token ids per request (no prefix-cache hits). Small vocabularies
    (the byte-level tiny model) use ids 0-255; large ones skip the low ids, often special."""
    rng = random.Random(seed)
    lo, hi = (0, 256) if not vocab or vocab < 1024 else (1000, min(vocab, 32000))
    return [rng.randrange(lo, hi) for _ in range(n)]


def _one_request(client, body: dict) -> dict:
    """One streaming completion: TTFT, per-token gaps (from SSE chunk arrival), e2e."""
    t0 = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    ids: list[int] = []
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return {"error": str(obj["error"])[:200]}
                got = [t for c in obj.get("choices") or () for t in c.get("token_ids") or ()]
                ids += got
                n = len(got)
                if n:
                    times.append(time.perf_counter())
                    counts.append(n)
    except Exception as e:  # a failed request is counted, not raised
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    if not times:
        return {"error": "no tokens"}
    # A chunk of n tokens after a gap g counts as n gaps of g / n.
    itl = [
        (times[k] - times[k - 1]) / counts[k]
        for k in range(1, len(times))
        for _ in range(counts[k])
    ]
    return {
        "ttft": times[0] - t0,
        "e2e": time.perf_counter() - t0,
        "tokens": sum(counts),
        "itl": itl,
        "token_ids": ids,
    }


class _Counter:
    """The one-line progress counter on stderr when tqdm is not installed."""

    def __init__(self, total: int, desc: str, disable: bool) -> None:
        self.total, self.desc, self.disable, self.n = total, desc, disable, -1
        self.update()

    def update(self, k: int = 1) -> None:
        self.n += k
        if not self.disable:
            print(f"\r{self.desc}: {self.n}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.disable:
            print(file=sys.stderr, flush=True)


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, desc, disable=not enabled)
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=not enabled)


def run_level(
    url: str,
    model_name: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    deadline: float,
    desc: str,
    progress: bool = True,
    keep_token_ids: bool = False,
) -> dict:
    """Send the prompts with at most `concurrency` in flight; none starts after `deadline`.
    `keep_token_ids`: the result's `token_ids` maps each completed prompt's index to the
    token ids streamed back."""
    import httpx

    results: list[dict] = []
    lock = threading.Lock()
    nxt = iter(range(len(prompts)))
    bar = _progress(len(prompts), desc, progress)
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency + 2)

    def loop(client) -> None:
        while time.monotonic() < deadline:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            body = {
                "model": model_name,
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            out = _one_request(client, body)
            out["index"] = i
            with lock:
                results.append(out)
                bar.update()

    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=timeout, limits=limits, trust_env=False) as client:
        with ThreadPoolExecutor(concurrency) as ex:
            for f in [ex.submit(loop, client) for _ in range(concurrency)]:
                f.result()
    wall = time.perf_counter() - t0
    bar.close()
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    series = {
        "ttft": [r["ttft"] for r in ok],
        "itl": [g for r in ok for g in r["itl"]],
        "e2e": [r["e2e"] for r in ok],
    }
    row = {
        "concurrency": concurrency,
        "launched": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r["error"] for r in results if "error" in r})[:3],
        "seconds": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2) if ok else None,
        "requests_per_s": round(len(ok) / wall, 3) if ok else None,
        **{f"{k}_ms_p{q}": _ms(v, q) for k, v in series.items() for q in (50, 90)},
    }
    if keep_token_ids:
        row["token_ids"] = {r["index"]: r["token_ids"] for r in ok}
    return row


def _start_workers(roles: list[str], args: list[str], env: dict | None) -> list:
    from hybrid_pd.launcher.local import start_worker

    with ThreadPoolExecutor(len(roles)) as ex:
        futures = [ex.submit(start_worker, role, *args, env=env, timeout=120) for role in roles]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    for w in started if errors else ():
        w.stop()
    if errors:
        raise errors[0]
    return started


def worker_kv_check(workers: list, timeout: float = 10.0) -> list[dict]:
    """Each worker's KV state once idle (or at `timeout`): no blocks held, no leases."""
    from hybrid_pd.proxy.worker_client import WorkerClient

    out = []
    for w in workers:
        client = WorkerClient(w.address, timeout_s=5)
        try:
            deadline = time.monotonic() + timeout
            while True:
                s = client.stats()
                clean = (
                    s["kv_requests"] == 0
                    and s.get("leases", 0) == 0
                    and s["free_blocks"] == s["num_blocks"] - 1
                    and s["running"] == 0
                    and s["waiting"] == 0
                )
                if clean or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            client.close()
        keys = ("num_blocks", "free_blocks", "kv_requests", "running", "waiting")
        out.append(
            {
                "role": w.role,
                **{k: s[k] for k in keys},
                "leases": s.get("leases", 0),
                "leaked_blocks": s["num_blocks"] - 1 - s["free_blocks"],
                "clean": clean,
            }
        )
    return out


def _routes(url: str) -> dict[str, int]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    pat = r'^hybrid_pd_proxy_routes_total\{route="(\w+)"\} ([0-9.e+]+)$'
    return {m[1]: int(float(m[2])) for m in re.finditer(pat, text, re.M) if float(m[2])}


def _run_setup(
    setup: str,
    path: Path,
    model_name: str,
    worker_args: list[str],
    env: dict | None,
    levels: list[int],
    prompts: dict[int, list[list[int]]],
    warm: list[int],
    max_tokens: int,
    budget_s: float,
    progress: bool,
) -> dict:
    from hybrid_pd.proxy.config import ProxyConfig
    from hybrid_pd.proxy.server import ProxyHandle

    workers = _start_workers(["prefill", "decode"] if setup == "pd" else ["both"], worker_args, env)
    proxy = None
    try:
        # P/D: every prompt takes the prefill worker. Aggregated: its one worker is in both
        # pools but no prompt reaches min_prefill_tokens, so each runs wholly on it.
        config = ProxyConfig(
            served_model_names=(model_name,),
            model_path=str(path),
            port=0,
            prefill_addresses=(workers[0].address,),
            decode_addresses=(workers[-1].address,),
            min_prefill_tokens=1 if setup == "pd" else NEVER,
        )
        proxy = ProxyHandle(config, port=0).start()
        # Warm-up (not measured): the first forward passes of a fresh process are slow.
        w = run_level(
            proxy.url,
            model_name,
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
                model_name,
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
    from hybrid_pd.engine.tiny import resolve_model

    path = resolve_model(model)
    model_name = model if model == "tiny" else Path(model).name
    cfg = json.loads((path / "config.json").read_text())
    vocab = (cfg.get("text_config") or {}).get("vocab_size") or cfg.get("vocab_size")
    levels = list(concurrency)
    prompts = {c: [_prompt(f"{c}-{i}", prompt_len, vocab) for i in range(requests)] for c in levels}
    args = ["--model", str(path), "--kv-memory", kv_memory, "--threads", str(threads)]
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
        out = _run_setup(
            setup, path, model_name, args, env, levels, prompts, warm, max_tokens, budget, progress
        )
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
        return _cmd_bench_serve_peer(args, load)
    result = bench_serve(plot=args.plot, **load)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        cols = {
            "concurrency": "conc",
            "completed": "done",
            "errors": "err",
            "output_tokens_per_s": "tok/s",
            "requests_per_s": "req/s",
            "ttft_ms_p50": "TTFT p50 ms",
            "ttft_ms_p90": "TTFT p90",
            "itl_ms_p50": "ITL p50",
            "itl_ms_p90": "ITL p90",
            "e2e_ms_p50": "e2e p50",
            "e2e_ms_p90": "e2e p90",
        }
        for setup, rows in result["setups"].items():
            print(f"{setup} (routes {result['routes'][setup]}):")
            print(" ".join(f"{c:>11}" for c in cols.values()))
            for r in rows:
                print(" ".join(f"{'-' if r[c] is None else r[c]:>11}" for c in cols))
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


def _cmd_bench_serve_peer(args: argparse.Namespace, load: dict[str, Any]) -> int:
    from hybrid_pd.launcher.bench_peer import peer_python
    from hybrid_pd.launcher.bench_serve_peer import bench_serve_peer

    if args.plot:
        print("--plot is not drawn with --peer", file=sys.stderr)
    result = bench_serve_peer(
        peer_python=peer_python(args.peer_python), reps=args.reps, progress=not args.json, **load
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['model']} ({result['dtype']}): ours (proxy + one worker) / vLLM's OpenAI "
            f"server, medians of {result['reps']} alternating reps"
        )
        print(f"{'conc':>5} {'tok/s ours':>11} {'vLLM':>8} {'ratio':>6} {'TTFT p50 ours':>14} "
              f"{'vLLM':>8} {'ITL p50 ours':>13} {'vLLM':>8}")  # fmt: skip
        for a, b, r in zip(
            result["setups"]["ours"], result["setups"]["vllm"], result["ratios"], strict=True
        ):
            print(
                f"{a['concurrency']:>5} {a['output_tokens_per_s']!s:>11} "
                f"{b['output_tokens_per_s']!s:>8} {r['output_tokens_per_s']!s:>6} "
                f"{a['ttft_ms_p50']!s:>14} {b['ttft_ms_p50']!s:>8} "
                f"{a['itl_ms_p50']!s:>13} {b['itl_ms_p50']!s:>8}"
            )
        g = result["greedy"]
        print(f"greedy token ids equal: {g['equal']}/{g['compared']} requests")
        print("no leaked KV blocks" if result["no_leaks"] else f"LEAKS: {result['workers']}")
    ok = result["no_leaks"] and result["errors"] == 0
    return 0 if ok else 1
