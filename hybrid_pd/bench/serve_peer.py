"""`hybrid-pd bench serve --peer vllm`: the whole serving stack against vLLM's OpenAI server.

Ours is the proxy in front of one aggregated worker (role `both`); vLLM's is its OpenAI API
server (`python -m vllm.entrypoints.openai.api_server`, eager) under its own Python. Both
serve the same checkpoint in its own dtype, with the same KV memory and the same most
sequences per step, and take the same streaming completions (the same prompt token ids,
greedy, `ignore_eos`) at each concurrency level; every repetition and level has prompts of
its own (`rep_prompts`: a prompt seen before would measure the prefix caches). Each side
keeps its own defaults otherwise (the tokens one step may batch, its HTTP server): what an
operator gets from either.

Both stay up for the whole run; repetitions alternate which side goes first. While ours is
measured, vLLM's processes are stopped (SIGSTOP): its idle worker polls for work and would
take CPU from ours. vLLM's compute threads are bound to the bench CPUs
(VLLM_CPU_OMP_THREADS_BIND); ours runs `--threads` torch threads, unbound, as `serve` starts
it. Figures are medians over the repetitions; the ratios are ours / vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybrid_pd.bench.completions import _prompt, run_level
from hybrid_pd.bench.peer_vllm import agreeing_tokens
from hybrid_pd.bench.service import NEVER, _start_workers, start_proxy, worker_kv_check

#: What the JSON's `ratios` compare per level (ours / vLLM).
RATIO_KEYS = ("output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "e2e_ms_p50")


def _median_rows(reps: list[list[dict]]) -> list[dict]:
    """Per level, the median of every numeric figure over the repetitions."""
    out = []
    for rows in zip(*reps, strict=True):
        merged: dict[str, Any] = {"concurrency": rows[0]["concurrency"]}
        for key, value in rows[0].items():
            if key == "concurrency" or not (value is None or isinstance(value, int | float)):
                continue  # lists and samples, not figures
            values = [r[key] for r in rows if r.get(key) is not None]
            merged[key] = round(statistics.median(values), 3) if values else None
        merged["errors"] = sum(r["errors"] for r in rows)
        merged["error_samples"] = sorted({e for r in rows for e in r["error_samples"]})[:3]
        out.append(merged)
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def bench_serve_peer(
    model: str,
    concurrency: list[int],
    requests: int,
    max_seconds: float,
    prompt_len: int,
    max_tokens: int,
    kv_memory: str,
    threads: int,
    peer_python: str,
    reps: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    from hybrid_pd.api.sizes import parse_bytes
    from hybrid_pd.bench.peer import bench_cpus, checkpoint_config, checkpoint_dtype
    from hybrid_pd.bench.vllm_servers import Server
    from hybrid_pd.engine.tiny import resolve_model

    if reps < 1:
        raise ValueError("--reps must be at least 1")
    path = resolve_model(model)
    model_name = path.name
    vocab = checkpoint_config(path).get("vocab_size")
    dtype = checkpoint_dtype(path)
    levels = list(concurrency)
    seqs = max(levels)
    kv_bytes = parse_bytes(kv_memory)
    cpus = bench_cpus(threads)
    warm = _prompt("warmup", prompt_len, vocab)
    budget = max_seconds / (2 * reps)  # per side and repetition: no request starts after it

    worker_args = ["--model", str(path), "--kv-memory", kv_memory, "--threads", str(threads)]
    worker_args += ["--max-num-seqs", str(seqs)]
    log = Path(tempfile.mkstemp(prefix="hybrid-pd-bench-serve-vllm-", suffix=".log")[1])
    peer = Server(
        path,
        log,
        dtype=dtype,
        cpus=",".join(map(str, cpus)),
        python=peer_python,
        max_num_seqs=seqs,
        kv_cache_bytes=kv_bytes,
        max_model_len=max(1024, prompt_len + max_tokens),
    )
    workers: list = []
    proxy = None
    try:
        workers = _start_workers(["both"], worker_args, None)
        proxy = start_proxy(model_name, path, workers, workers, min_prefill_tokens=NEVER)
        peer.wait_ready()
        urls = {"ours": proxy.url, "vllm": peer.url}
        names = {"ours": model_name, "vllm": str(path)}  # vLLM serves it under its path

        def run(side, prompts_of: dict[int, list[list[int]]], deadline, desc, show=progress):
            """Each level's prompts on one side, the other side's processes stopped."""
            if side == "ours":
                peer.pause()
            try:
                return [
                    run_level(
                        urls[side],
                        names[side],
                        level_prompts,
                        max_tokens,
                        c,
                        deadline,
                        f"{side} {desc} c={c}",
                        show,
                        keep_token_ids=True,
                    )
                    for c, level_prompts in prompts_of.items()
                ]
            finally:
                peer.resume()

        for side in ("ours", "vllm"):  # warm-up, not measured: a fresh process's first passes
            (got,) = run(side, {1: [warm]}, time.monotonic() + 600, "warm-up", show=False)
            if got["errors"]:
                raise RuntimeError(f"{side}: the warm-up request failed: {got['error_samples']}")

        per_rep: dict[str, list[list[dict]]] = {"ours": [], "vllm": []}
        for rep in range(reps):
            order = ("ours", "vllm") if rep % 2 == 0 else ("vllm", "ours")
            for side in order:
                prompts = rep_prompts(levels, requests, prompt_len, vocab, rep)
                per_rep[side].append(run(side, prompts, time.monotonic() + budget, f"rep {rep}"))
        proxy.stop()
        proxy = None
        kv_check = worker_kv_check(workers)
    except BaseException:
        print(f"vLLM's server log: {log}", file=sys.stderr)
        raise
    finally:
        if proxy is not None:
            proxy.stop()
        for w in workers:
            w.stop()
        peer.stop()

    errors = sum(r["errors"] for rows in per_rep.values() for rep in rows for r in rep)
    peer_log = str(log) if errors else None  # kept where something failed
    if not errors:
        log.unlink(missing_ok=True)
    greedy = _greedy_agreement(per_rep)
    for side in per_rep:  # the ids served their purpose: the JSON keeps figures only
        for rows in per_rep[side]:
            for row in rows:
                row.pop("token_ids", None)
    ours, theirs = _median_rows(per_rep["ours"]), _median_rows(per_rep["vllm"])
    ratios = []
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        row: dict[str, Any] = {"concurrency": a["concurrency"]}
        for key in RATIO_KEYS:
            row[key] = _ratio(a[key], b[key])
            row[f"{key}_reps"] = [
                _ratio(x[k][key], y[k][key])
                for x, y in zip(per_rep["ours"], per_rep["vllm"], strict=True)
            ]
        ratios.append(row)
    return {
        "model": model,
        "peer": "vllm",
        "dtype": dtype,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "requests": requests,
        "reps": reps,
        "max_seconds": max_seconds,
        "threads": {"ours": threads, "vllm_omp_threads_bind": cpus},
        "max_num_seqs": seqs,
        "kv_memory_bytes": kv_bytes,
        "setups": {"ours": ours, "vllm": theirs},
        "reps_rows": per_rep,
        "ratios": ratios,
        "greedy": greedy,
        "workers": {"ours": kv_check},
        "no_leaks": all(w["clean"] for w in kv_check),
        "errors": errors,
        "peer_log": peer_log,
    }


def rep_prompts(
    levels: list[int], requests: int, prompt_len: int, vocab: int | None, rep: int
) -> dict[int, list[list[int]]]:
    """Each level's prompts in repetition `rep`: the same on both sides, new in every
    repetition and level. A prompt seen before would hit a prefix cache, and the two sides do
    not cache alike (ours caches, the vLLM server here runs with prefix caching off, as
    Granite-4.0-H in float32 needs on vLLM's CPU build): a second repetition of the same
    prompts measured our cache, not serving."""
    return {
        c: [_prompt(f"rep{rep}-{c}-{i}", prompt_len, vocab) for i in range(requests)]
        for c in levels
    }


def _greedy_agreement(per_rep: dict[str, list[list[dict]]]) -> dict[str, Any]:
    """Requests whose greedy token ids both sides returned, how many of them are equal, and
    where the others part (the first repetition's; a request cut by the time budget on
    either side is left out)."""
    both = equal = 0
    differing = []
    for a, b in zip(per_rep["ours"][0], per_rep["vllm"][0], strict=True):
        ids_a, ids_b = a.get("token_ids") or {}, b.get("token_ids") or {}
        for i in sorted(ids_a.keys() & ids_b.keys()):
            both += 1
            if ids_a[i] == ids_b[i]:
                equal += 1
                continue
            first = agreeing_tokens(ids_a[i], ids_b[i])
            differing.append({"concurrency": a["concurrency"], "request": i, "first_token": first})
    return {"compared": both, "equal": equal, "differing": differing}


def cmd_bench_serve_peer(args: argparse.Namespace, load: dict[str, Any]) -> int:
    """`bench serve --peer vllm`: run `bench_serve_peer` with the load flags `load` (see
    `serve._load_args`), print its figures (JSON with --json); 0 when no request failed and
    no KV block leaked."""
    from hybrid_pd.bench.peer import peer_python

    if args.plot:
        print("--plot is not drawn with --peer", file=sys.stderr)
    result = bench_serve_peer(
        peer_python=peer_python(args.peer_python), reps=args.reps, progress=not args.json, **load
    )
    print(json.dumps(result, indent=2) if args.json else _summary(result))
    ok = result["no_leaks"] and result["errors"] == 0
    return 0 if ok else 1


def _summary(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} ({result['dtype']}): ours (proxy + one worker) / vLLM's OpenAI "
        f"server, medians of {result['reps']} alternating reps",
        f"{'conc':>5} {'tok/s ours':>11} {'vLLM':>8} {'ratio':>6} {'TTFT p50 ours':>14} "
        f"{'vLLM':>8} {'ITL p50 ours':>13} {'vLLM':>8}",
    ]
    for a, b, r in zip(
        result["setups"]["ours"], result["setups"]["vllm"], result["ratios"], strict=True
    ):
        lines.append(
            f"{a['concurrency']:>5} {a['output_tokens_per_s']!s:>11} "
            f"{b['output_tokens_per_s']!s:>8} {r['output_tokens_per_s']!s:>6} "
            f"{a['ttft_ms_p50']!s:>14} {b['ttft_ms_p50']!s:>8} "
            f"{a['itl_ms_p50']!s:>13} {b['itl_ms_p50']!s:>8}"
        )
    g = result["greedy"]
    lines.append(f"greedy token ids equal: {g['equal']}/{g['compared']} requests")
    lines.append("no leaked KV blocks" if result["no_leaks"] else f"LEAKS: {result['workers']}")
    return "\n".join(lines)
