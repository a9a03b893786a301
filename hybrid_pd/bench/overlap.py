"""`hybrid-pd bench overlap`: a long prompt's hand-over with and without overlap.

One prefill worker (prefilling in chunks of `--chunk` tokens) and one decode worker, two
proxies in front of them: one plain, one with `overlap_transfer`. Each repetition sends
`--concurrency` fresh prompts at once (no prefix-cache hits) through each proxy, in
alternating order, streaming: the first token comes from the prefill reply, the second only
once decode holds the KV. `wait` (second-token time minus first-token time) is what the client
waits for the hand-over and decode's first step; overlap moves the attention blocks
while the prompt computes, so only the last chunk's blocks and the state pages remain.
`--ucx-tls tcp,self` has the KV cross TCP (a hand-over between hosts) instead of shared
memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybrid_pd.bench.completions import _prompt, completion_chunks
from hybrid_pd.bench.multiturn import _start
from hybrid_pd.bench.service import BenchModel, start_proxy, worker_kv_check

MODES = ("off", "on")


def add_overlap_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser(
        "overlap", help="a long prompt's P/D hand-over with and without overlap (proxy)"
    )
    s.add_argument("--model", default="tiny", help="`tiny` or a checkpoint folder")
    s.add_argument("--prompt-len", type=int, default=16384)
    s.add_argument("--chunk", type=int, default=2048, help="the prefill worker's step tokens")
    s.add_argument("--reps", type=int, default=2, help="rounds per mode (alternating)")
    s.add_argument("--concurrency", type=int, default=1, help="prompts sent at once per round")
    s.add_argument("--max-tokens", type=int, default=4)
    s.add_argument("--kv-memory", default="2GiB", help="KV memory of each worker")
    s.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    s.add_argument("--ucx-tls", default=None, help="UCX transports of both workers")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_bench_overlap)


def _stream(client, body: dict) -> dict:
    """One streaming completion: first- and second-token times and the token ids."""
    t0 = time.perf_counter()
    times: list[float] = []  # since t0, per token
    ids: list[int] = []
    for chunk in completion_chunks(client, body):
        for c in chunk.get("choices") or ():
            new = c.get("token_ids") or ()
            times += [time.perf_counter() - t0] * len(new)
            ids += new
    if len(ids) < 2:
        raise RuntimeError(f"expected at least two tokens, got {len(ids)}")
    return {
        "first_s": times[0],
        "second_s": times[1],
        "wait_s": times[1] - times[0],
        "done_s": times[-1],
        "ids": ids,
    }


def bench_overlap(
    model: str = "tiny",
    prompt_len: int = 16384,
    chunk: int = 2048,
    reps: int = 2,
    max_tokens: int = 4,
    kv_memory: str = "2GiB",
    threads: int = 1,
    ucx_tls: str | None = None,
    env: dict[str, str] | None = None,
    concurrency: int = 1,
) -> dict[str, Any]:
    """The runs and their medians (see the module's docstring); `env`: the workers'."""
    import httpx

    from hybrid_pd.proxy.worker_client import WorkerClient

    if min(prompt_len, chunk, reps, concurrency) < 1 or max_tokens < 2:
        raise ValueError("prompt_len, chunk, reps and concurrency must be >= 1, max_tokens >= 2")
    m = BenchModel.resolve(model)
    path, vocab = m.path, m.vocab
    common = m.worker_args(kv_memory, threads)
    if ucx_tls:
        common += ["--ucx-tls", ucx_tls]
    (prefill,) = _start([("prefill", [*common, "--max-num-batched-tokens", str(chunk)])], env)
    workers = [prefill]
    proxies: dict[str, Any] = {}
    try:
        workers += _start([("decode", [*common, "--peer", prefill.address])], env)
        for mode in MODES:
            proxies[mode] = start_proxy(
                "m", path, [prefill], workers[1:2], min_prefill_tokens=1,
                overlap_transfer=mode == "on",
            )  # fmt: skip
        runs = []
        timeout = httpx.Timeout(3600.0, connect=10.0)
        order = [(r, m) for r in range(reps) for m in (MODES if r % 2 == 0 else MODES[::-1])]
        warm = _prompt("overlap-warm", min(prompt_len, 256), vocab)
        for i, (rep, mode) in enumerate([(-1, "off"), (-1, "on"), *order]):
            n = 1 if rep < 0 else concurrency
            bodies = [
                {
                    "model": "m",
                    "prompt": warm if rep < 0 else _prompt(f"overlap-{i}-{j}", prompt_len, vocab),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                }
                for j in range(n)
            ]
            limits = httpx.Limits(max_connections=n + 1)
            with (
                httpx.Client(
                    base_url=proxies[mode].url, timeout=timeout, limits=limits, trust_env=False
                ) as c,
                ThreadPoolExecutor(n) as ex,
            ):
                outs = list(ex.map(lambda b, c=c: _stream(c, b), bodies))
            if rep < 0:
                continue  # warm-up: not measured
            # Per round: the medians over its requests, and when its last token came.
            out = {k: statistics.median(o[k] for o in outs) for k in ("first_s", "second_s")}
            out["wait_s"] = statistics.median(o["wait_s"] for o in outs)
            out["done_s"] = max(o["done_s"] for o in outs)
            stats = WorkerClient(workers[1].address, timeout_s=10).stats()["decode_connector"]
            runs.append(
                {
                    "mode": mode,
                    "rep": rep,
                    **{k: round(v, 4) for k, v in out.items()},
                    "staged_bytes_total": stats["staged_bytes"],
                    "bytes_total": stats["bytes"],
                }
            )
        summary = {
            m: {
                k: round(statistics.median(r[k] for r in runs if r["mode"] == m), 4)
                for k in ("first_s", "second_s", "wait_s", "done_s")
            }
            for m in MODES
        }
        summary["wait_ratio"] = round(summary["on"]["wait_s"] / summary["off"]["wait_s"], 3)
        summary["second_token_ratio"] = round(
            summary["on"]["second_s"] / summary["off"]["second_s"], 3
        )
        summary["done_ratio"] = round(summary["on"]["done_s"] / summary["off"]["done_s"], 3)
        kv = worker_kv_check(workers)
    finally:
        for handle in proxies.values():
            handle.stop()
            handle.pool.close()
        for w in workers:
            w.stop()
    return {
        "config": {
            "model": m.name,
            "prompt_len": prompt_len,
            "chunk": chunk,
            "reps": reps,
            "concurrency": concurrency,
            "threads": threads,
            "ucx_tls": ucx_tls or "default",
        },
        "runs": runs,
        "summary": summary,
        "workers": kv,
    }


def _cmd_bench_overlap(args: argparse.Namespace) -> int:
    try:
        result = bench_overlap(
            args.model,
            args.prompt_len,
            args.chunk,
            args.reps,
            args.max_tokens,
            args.kv_memory,
            args.threads,
            args.ucx_tls,
            concurrency=args.concurrency,
        )
    except ValueError as e:
        print(f"hybrid-pd bench overlap: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    s = result["summary"]
    for m in MODES:
        print(
            f"overlap {m:>3}: first token {s[m]['first_s']:.3f} s, second {s[m]['second_s']:.3f}"
            f" s, hand-over wait {s[m]['wait_s']:.3f} s"
        )
    print(f"wait on/off {s['wait_ratio']}, second token on/off {s['second_token_ratio']}")
    return 0
