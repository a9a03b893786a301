"""`hybrid-pd bench ...`: benchmarks that print JSON figures."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from hybrid_pd.kvcache.planner import held_state_rows_arg
from hybrid_pd.launcher.bench_vllm import add_bench_vllm


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its figures")
    bsub = p.add_subparsers(dest="bench", required=True)
    k = bsub.add_parser("kvcache", help="allocator throughput and the planner table")
    k.add_argument("--requests", type=int, default=10_000)
    k.add_argument(
        "--model", default="gemma-3-27b-it", help="reference config to drive the allocator with"
    )
    k.add_argument("--kv-memory", default="16GiB")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_bench_kvcache)
    e = bsub.add_parser(
        "engine",
        help="prefill/decode tokens/s next to transformers, or next to vLLM (--peer vllm)",
        description="Prefill and decode tokens/s of our engine next to transformers' generate "
        "(same process), or with `--peer vllm` next to vLLM's offline engine on the same "
        "checkpoint, run under vLLM's own Python and alternated rep by rep: e.g. "
        "`hybrid-pd bench engine --model PATH --peer vllm --peer-python .venv-vllm/bin/python "
        "--batch-sizes 1,8,32 --threads 1 --json` (see docs/vllm.md).",
    )
    e.add_argument("--model", default="tiny")
    e.add_argument("--prompt-len", type=int, default=256)
    e.add_argument("--decode-tokens", type=int, default=32)
    e.add_argument("--batch-sizes", default="1,32")
    e.add_argument("--no-transformers", action="store_true", help="skip the reference")
    e.add_argument(
        "--peer", choices=("vllm",), default=None, help="compare with vLLM instead of transformers"
    )
    e.add_argument(
        "--peer-python",
        default=None,
        help="the Python that has vLLM (default: $HYBRID_PD_VLLM_PYTHON)",
    )
    e.add_argument("--peer-env", action="append", default=[], help="KEY=VALUE for the vLLM process")
    e.add_argument(
        "--confine-peer",
        action="store_true",
        help="--peer: run every vLLM process on the benchmark's CPUs, not only its model "
        "worker's threads (its front end and engine core otherwise use any free CPU)",
    )
    e.add_argument("--reps", type=int, default=2, help="alternating repetitions (--peer)")
    e.add_argument("--dtype", default=None, help="default: the checkpoint's, else float32")
    e.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for each side (default: this process's CPUs; --peer: 1)",
    )
    e.add_argument("--seed", type=int, default=0, help="prompt ids (--peer)")
    e.add_argument(
        "--held-state-rows",
        type=held_state_rows_arg,
        default=None,
        help="our engine's memory for decode rows' states held between steps (bytes or "
        "256MiB; 0 turns it off; default the engine's)",
    )
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_bench_engine)
    add_bench_vllm(bsub)
    t = bsub.add_parser("transfer", help="KV hand-over bandwidth next to raw ucxx")
    t.add_argument("--model", default="qwen3.5-27b", help="reference config for the layout")
    t.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--ucx-tls", default=None, help="UCX_TLS for both sides (e.g. tcp)")
    t.add_argument(
        "--churn",
        type=int,
        default=0,
        help="mixed requests run through both pools before measuring (fragmentation)",
    )
    t.add_argument("--seed", type=int, default=0, help="seed of the churn")
    t.add_argument(
        "--no-scatter-gather",
        dest="scatter_gather",
        action="store_false",
        help="one UCX message per run of blocks (the hand-over before scatter-gather messages)",
    )
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_cmd_bench_transfer)
    from hybrid_pd.launcher.bench_load import add_load_parser
    from hybrid_pd.launcher.bench_multiturn import add_multiturn_parser
    from hybrid_pd.launcher.bench_overlap import add_overlap_parser
    from hybrid_pd.launcher.bench_proxy import add_proxy_parser
    from hybrid_pd.launcher.bench_serve import add_serve_parser

    add_serve_parser(bsub)
    add_load_parser(bsub)
    add_proxy_parser(bsub)
    add_multiturn_parser(bsub)
    add_overlap_parser(bsub)


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
    from hybrid_pd.kvcache.planner import parse_bytes

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


def bench_engine(
    model_name: str,
    prompt_len: int,
    decode_tokens: int,
    batch_sizes: list[int],
    with_transformers: bool = True,
    threads: int | None = None,
    dtype: str | None = None,
    held_state_rows_bytes: int | None = None,
) -> dict[str, Any]:
    """Prefill and decode throughput of our engine and of transformers' generate, same
    checkpoint, same prompts, same process. Prefill time is the time to the first token;
    decode tokens/s counts the tokens after it."""
    import torch

    from hybrid_pd.engine.engine import Engine, EngineConfig
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.malloc import tune_malloc
    from hybrid_pd.engine.sampling import SamplingParams
    from hybrid_pd.engine.threads import set_torch_threads
    from hybrid_pd.engine.tiny import resolve_model

    threads = set_torch_threads(threads)
    tune_malloc()
    path = resolve_model(model_name)
    model, config, tok = load_model(path, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    hf = None
    if with_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
    for bs in batch_sizes:
        prompts = [torch.randint(0, 256, (prompt_len,), generator=gen).tolist() for _ in range(bs)]
        engine = Engine(
            model,
            config,
            EngineConfig(
                kv_memory_bytes=1 << 30,
                max_num_batched_tokens=prompt_len * bs,
                enable_prefix_caching=False,
                held_state_rows_bytes=held_state_rows_bytes,
            ),
            tok,
        )
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        t0 = time.perf_counter()
        first = None
        while engine.has_unfinished():
            engine.step()
            if first is None:
                first = time.perf_counter()
        t1 = time.perf_counter()
        row = {
            "batch_size": bs,
            "prompt_len": prompt_len,
            "decode_tokens": decode_tokens,
            "ours_prefill_tokens_per_s": round(bs * prompt_len / (first - t0), 1),
            "ours_decode_tokens_per_s": round(bs * (decode_tokens - 1) / (t1 - first), 1),
        }
        if hf is not None:
            ids = torch.tensor(prompts)
            clock = _TokenClock()  # timestamps each token step inside one generate call
            with torch.no_grad():
                hf.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
                t0 = time.perf_counter()
                hf.generate(
                    ids,
                    max_new_tokens=decode_tokens,
                    do_sample=False,
                    pad_token_id=0,
                    streamer=clock,
                )
            first_token, last_token = clock.times[1], clock.times[-1]  # [0] is the prompt
            prefill = first_token - t0
            decode = max(1e-9, last_token - first_token)
            row["transformers_prefill_tokens_per_s"] = round(bs * prompt_len / prefill, 1)
            row["transformers_decode_tokens_per_s"] = round(bs * (decode_tokens - 1) / decode, 1)
            row["prefill_ratio"] = round(
                row["ours_prefill_tokens_per_s"] / row["transformers_prefill_tokens_per_s"], 3
            )
            row["decode_ratio"] = round(
                row["ours_decode_tokens_per_s"] / row["transformers_decode_tokens_per_s"], 3
            )
        rows.append(row)
    device = str(next(model.parameters()).device)
    return {"model": model_name, "device": device, "threads": threads, "runs": rows}


class _TokenClock:
    """A transformers streamer that only records when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    if args.peer == "vllm":
        return _cmd_bench_engine_peer(args, sizes)
    from hybrid_pd.engine.heap import frozen_heap

    with frozen_heap():  # as in every engine process (imports make most of the heap)
        result = bench_engine(
            args.model,
            args.prompt_len,
            args.decode_tokens,
            sizes,
            not args.no_transformers,
            threads=args.threads,
            dtype=args.dtype,
            held_state_rows_bytes=args.held_state_rows,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for r in result["runs"]:
            print(", ".join(f"{k}={v}" for k, v in r.items()))
    return 0


def _cmd_bench_engine_peer(args: argparse.Namespace, sizes: list[int]) -> int:
    from hybrid_pd.launcher.bench_peer import bench_engine_peer, parse_env, peer_python, summary

    result = bench_engine_peer(
        args.model,
        args.prompt_len,
        args.decode_tokens,
        sizes,
        peer_python=peer_python(args.peer_python),
        reps=args.reps,
        dtype=args.dtype,
        threads=args.threads or 1,
        peer_env=parse_env(args.peer_env),
        seed=args.seed,
        confine_peer=args.confine_peer,
        held_state_rows_bytes=args.held_state_rows,
    )
    print(json.dumps(result, indent=2) if args.json else summary(result))
    return 0


def _cmd_bench_transfer(args: argparse.Namespace) -> int:
    from hybrid_pd.connector.transfer_bench import bench_transfer

    lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
    if args.churn < 0:
        raise SystemExit("--churn must be >= 0")
    result = bench_transfer(
        args.model,
        lengths,
        args.repeats,
        args.ucx_tls,
        churn=args.churn,
        seed=args.seed,
        scatter_gather=args.scatter_gather,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['model']}: block {result['block_size']}, page "
            f"{result['page_size_bytes']} B, {result['num_groups']} groups, churn {result['churn']}"
        )
        for r in result["runs"]:
            print(
                f"{r['tokens']:>6} tokens {r['bytes'] / 2**20:9.1f} MiB "
                f"{r['messages_per_request']:>7} msgs/req  KV {r['kv_gb_per_s']:6.2f} GB/s  raw "
                f"{r['raw_gb_per_s']:6.2f} GB/s  ratio {r['ratio']:.2f}"
            )
    return 0
