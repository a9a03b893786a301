"""`hybrid-pd bench multiturn`: multi-turn chats through the proxy, where each turn's prompt is
the previous turn's prompt and answer plus a new user message, so decode workers can reuse
what their prefix cache holds (decode-side prefix reuse) instead of pulling it again.

Prompts are token ids (no chat template): turn t of a chat is
system + (user_1 + answer_1) + ... + user_t, answer_i being the exact ids the proxy streamed
back (`return_token_ids`). Round t sends turn t of every chat at once (streaming, for TTFT).
Setups: `reuse` (decode takes its cached prefix, proxy routes by prefix), `no-reuse` (decode
workers with `--no-prefix-reuse-on-load`: they pull every block) and `load-routing` (reuse on,
proxy routes to the least loaded decode worker)."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybrid_pd.bench.completions import StreamError, _ms, _progress, _prompt, completion_chunks
from hybrid_pd.bench.service import BenchModel, start_proxy, worker_kv_check

#: setup -> (decode-side prefix reuse on, the proxy's kv_routing policy)
SETUPS: dict[str, tuple[bool, str]] = {
    "reuse": (True, "prefix"),
    "no-reuse": (False, "prefix"),
    "load-routing": (True, "load"),
}


def add_multiturn_parser(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser(
        "multiturn",
        help="multi-turn chats through the proxy: decode-side prefix reuse and KV routing",
    )
    s.add_argument("--conversations", type=int, default=4, help="chats, sent concurrently")
    s.add_argument("--turns", type=int, default=8, help="turns of each chat")
    s.add_argument(
        "--system-len", type=int, default=2048, help="tokens of the shared system prompt"
    )
    s.add_argument("--user-len", type=int, default=64, help="tokens of each new user message")
    s.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer (greedy)")
    s.add_argument("--prefill-workers", type=int, default=1)
    s.add_argument("--decode-workers", type=int, default=2)
    s.add_argument("--model", default="tiny", help="`tiny` or a checkpoint folder")
    s.add_argument("--kv-memory", default="256MiB", help="KV memory of each worker")
    s.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    s.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"comma-separated, among {', '.join(SETUPS)}",
    )
    s.add_argument(
        "--max-seconds",
        type=float,
        default=600.0,
        help="load budget of the run (shared by the setups): no round starts after it",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_bench_multiturn)


def _chat_turn(client, body: dict) -> dict:
    """One streaming completion: TTFT and the output token ids, or an error."""
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    rid = None
    try:
        for obj in completion_chunks(client, body):
            rid = rid or obj.get("id")
            for c in obj.get("choices") or ():
                new = c.get("token_ids") or ()
                if new and ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(new)
    except StreamError as e:
        return {"error": str(e)}
    except Exception as e:  # a failed request is counted, not raised
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    if ttft is None:
        return {"error": "no tokens"}
    return {"ttft": ttft, "ids": ids, "id": rid}


class _AccessWatch(logging.Handler):
    """The proxy's access log (same process): which decode worker served each request id."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.decode: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        pairs = dict(p.split("=", 1) for p in record.getMessage().split(" ") if "=" in p)
        if "id" in pairs and "decode" in pairs:
            self.decode[pairs["id"]] = pairs["decode"]

    def wait(self, ids: list[str], timeout: float = 5.0) -> None:
        """The lines are written when a response has ended, just after the client saw it."""
        deadline = time.monotonic() + timeout
        while any(i not in self.decode for i in ids) and time.monotonic() < deadline:
            time.sleep(0.01)


def _decode_counters(clients: list) -> list[dict]:
    """Each decode worker's connector counters now (in the order of `clients`)."""
    out = []
    for c in clients:
        s = c.stats()
        dc = s["decode_connector"]
        out.append(
            {
                "bytes": dc["bytes"],
                "held_blocks": dc["held_blocks"],
                "loads": dc["pulls"] + dc["failed"],
                "page_size_bytes": s["page_size_bytes"],
                "block_size": s["block_size"],
            }
        )
    return out


def _round_stats(before: list[dict], after: list[dict]) -> dict:
    """Decode-side figures of one round from the counters before and after it."""
    bytes_pulled = held = 0
    hit: dict[str, float | None] = {}
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        nbytes = a["bytes"] - b["bytes"]
        nheld = a["held_blocks"] - b["held_blocks"]
        # Pulled blocks: bytes / page size. Every block moved counts, state pages too
        # (Mamba/GDN state always comes from prefill, so a hit rate of 1 is out of reach on a
        # hybrid model: the held blocks are the attention groups' only).
        pulled = nbytes / a["page_size_bytes"] if a["page_size_bytes"] else 0
        hit[f"decode-{i}"] = round(nheld / (nheld + pulled), 4) if nheld + pulled else None
        bytes_pulled += nbytes
        held += nheld
    return {"bytes_pulled": bytes_pulled, "held_blocks": held, "hit_rate_by_worker": hit}


def _start(specs: list[tuple[str, list[str]]], env: dict | None) -> list:
    """Start workers (role, args) at once; all or none."""
    from hybrid_pd.launcher.local import start_worker

    with ThreadPoolExecutor(len(specs)) as ex:
        futures = [
            ex.submit(start_worker, role, *args, env=env, timeout=120) for role, args in specs
        ]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for w in started:
            w.stop()
        raise errors[0]
    return started


def _run_setup(
    setup: str,
    m: BenchModel,
    worker_args: list[str],
    env: dict | None,
    prefill_workers: int,
    decode_workers: int,
    system: list[int],
    users: list[list[list[int]]],
    warm: list[list[int]],
    max_tokens: int,
    budget_s: float,
    progress: bool,
) -> dict:
    import httpx

    from hybrid_pd.proxy.worker_client import WorkerClient

    reuse, policy = SETUPS[setup]
    decode_args = worker_args + ([] if reuse else ["--no-prefix-reuse-on-load"])
    specs = [("prefill", worker_args)] * prefill_workers + [("decode", decode_args)] * (
        decode_workers
    )
    workers = _start(specs, env)
    prefill, decode = workers[:prefill_workers], workers[prefill_workers:]
    clients = [WorkerClient(w.address, timeout_s=10) for w in decode]
    proxy = watch = None
    conversations, turns = len(users), len(users[0]) if users else 0
    try:
        # min_prefill_tokens 1: every turn is handed over from a prefill worker.
        proxy = start_proxy(
            m.name, m.path, prefill, decode, min_prefill_tokens=1, kv_routing=policy
        )
        addresses = [w.address for w in decode]
        access = logging.getLogger("hybrid_pd.access")
        watch = _AccessWatch()
        access.addHandler(watch)
        level, propagate = access.level, access.propagate
        access.setLevel(logging.INFO)
        access.propagate = False  # read here, not printed: the bench's output is its table
        timeout = httpx.Timeout(600.0, connect=10.0)
        limits = httpx.Limits(max_connections=max(conversations, len(warm)) + 2)
        with (
            httpx.Client(
                base_url=proxy.url, timeout=timeout, limits=limits, trust_env=False
            ) as client,
            ThreadPoolExecutor(max(conversations, len(warm), 1)) as ex,
        ):

            def send(prompt: list[int]) -> dict:
                body = {
                    "model": m.name,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                }
                return _chat_turn(client, body)

            # Warm-up (not measured, prompts unrelated to the chats): one request per decode
            # worker, at once, so each has run its first (slow) forward passes.
            for out in ex.map(send, warm):
                if "error" in out:
                    raise RuntimeError(f"{setup}: a warm-up request failed: {out['error']}")
            first = _decode_counters(clients[:1])[0]
            layout = {k: first[k] for k in ("block_size", "page_size_bytes")}
            history: list[list[int] | None] = [list(system) for _ in range(conversations)]
            served: list[list[int | None]] = [[] for _ in range(conversations)]
            rows: list[dict] = []
            bar = _progress(turns, setup, progress)
            deadline = time.monotonic() + budget_s
            for t in range(turns):
                if time.monotonic() >= deadline:
                    break
                live = [c for c in range(conversations) if history[c] is not None]
                prompts = {c: history[c] + users[c][t] for c in live}
                before = _decode_counters(clients)
                results = dict(zip(live, ex.map(send, [prompts[c] for c in live]), strict=True))
                after = _decode_counters(clients)
                errors = conversations - len(live)  # chats that failed earlier: lost turns
                for c in range(conversations):
                    out = results.get(c)
                    if out is None or "error" in out:
                        errors += out is not None
                        history[c] = None
                        served[c].append(None)
                        continue
                    history[c] = prompts[c] + out["ids"]
                    watch.wait([out["id"]])
                    where = watch.decode.get(out["id"])
                    served[c].append(addresses.index(where) if where in addresses else None)
                ttfts = [r["ttft"] for r in results.values() if "error" not in r]
                rows.append(
                    {
                        "turn": t + 1,
                        "requests": len(live),
                        "prompt_tokens_max": max((len(p) for p in prompts.values()), default=0),
                        "ttft_ms_median": _ms(ttfts, 50),
                        "ttft_ms_p90": _ms(ttfts, 90),
                        **_round_stats(before, after),
                        "errors": errors,
                        "error_samples": sorted(
                            {r["error"] for r in results.values() if "error" in r}
                        )[:3],
                    }
                )
                bar.update()
            bar.close()
        used = budget_s - max(0.0, deadline - time.monotonic())
        proxy.stop()
        proxy = None
        return {
            "kv_routing": policy,
            "prefix_reuse_on_load": reuse,
            "decode_layout": layout,
            "turns": rows,
            "routing": _routing(served),
            "workers": worker_kv_check(workers),
            "used_s": round(used, 3),
        }
    finally:
        if watch is not None:
            access.removeHandler(watch)
            access.setLevel(level)
            access.propagate = propagate
        for c in clients:
            c.close()
        if proxy is not None:
            proxy.stop()
        for w in workers:
            w.stop()


def _routing(served: list[list[int | None]]) -> dict:
    """How often a chat's turn >= 2 ran on the decode worker of its previous turn."""
    pairs = [
        (prev, cur)
        for chat in served
        for prev, cur in itertools.pairwise(chat)
        if prev is not None and cur is not None
    ]
    if not pairs:
        return {"same_decode_worker_fraction": None, "decode_worker_by_turn": served}
    same = sum(prev == cur for prev, cur in pairs)
    return {
        "same_decode_worker_fraction": round(same / len(pairs), 4),
        # per chat, the index (in the setup's decode workers) of the worker of each turn,
        # read from the proxy's access log
        "decode_worker_by_turn": served,
    }


def bench_multiturn(
    model: str = "tiny",
    conversations: int = 4,
    turns: int = 8,
    system_len: int = 2048,
    user_len: int = 64,
    max_tokens: int = 32,
    prefill_workers: int = 1,
    decode_workers: int = 2,
    setups: list[str] | tuple[str, ...] = tuple(SETUPS),
    max_seconds: float = 600.0,
    kv_memory: str = "256MiB",
    threads: int = 1,
    env: dict[str, str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:

    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setups {unknown}; choose among {list(SETUPS)}")
    for name, value in (
        ("conversations", conversations),
        ("turns", turns),
        ("prefill_workers", prefill_workers),
        ("decode_workers", decode_workers),
        ("max_tokens", max_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    m = BenchModel.resolve(model)
    vocab = m.vocab
    system = _prompt("system", system_len, vocab)
    users = [
        [_prompt(f"user-{c}-{t}", user_len, vocab) for t in range(turns)]
        for c in range(conversations)
    ]
    warm = [_prompt(f"warmup-{i}", max(system_len // 4, 16), vocab) for i in range(decode_workers)]
    args = m.worker_args(kv_memory, threads)
    result: dict[str, Any] = {
        "config": {
            "model": model,
            "conversations": conversations,
            "turns": turns,
            "system_len": system_len,
            "user_len": user_len,
            "max_tokens": max_tokens,
            "prefill_workers": prefill_workers,
            "decode_workers": decode_workers,
            "kv_memory": kv_memory,
            "threads": threads,
            "max_seconds": max_seconds,
            "setups": list(setups),
        },
        "setups": {},
    }
    spent = 0.0
    for k, setup in enumerate(setups):
        budget = max(0.0, max_seconds - spent) / (len(setups) - k)
        out = _run_setup(
            setup,
            m,
            args,
            env,
            prefill_workers,
            decode_workers,
            system,
            users,
            warm,
            max_tokens,
            budget,
            progress,
        )
        spent += out.pop("used_s")
        result["setups"][setup] = out
    result["errors"] = sum(r["errors"] for s in result["setups"].values() for r in s["turns"])
    result["no_leaks"] = all(w["clean"] for s in result["setups"].values() for w in s["workers"])
    return result


def _table(result: dict) -> str:
    cols = {
        "turn": "turn",
        "requests": "reqs",
        "prompt_tokens_max": "prompt",
        "ttft_ms_median": "TTFT p50 ms",
        "ttft_ms_p90": "TTFT p90",
        "bytes_pulled": "bytes pulled",
        "held_blocks": "held blocks",
        "hit_rate": "hit rate",
        "errors": "err",
    }
    lines = []
    for setup, s in result["setups"].items():
        lines.append(
            f"{setup} (prefix reuse {'on' if s['prefix_reuse_on_load'] else 'off'}, "
            f"kv_routing {s['kv_routing']}):"
        )
        lines.append(" ".join(f"{c:>12}" for c in cols.values()))
        for r in s["turns"]:
            rates = r["hit_rate_by_worker"].values()
            row = {**r, "hit_rate": "/".join("-" if x is None else f"{x:.2f}" for x in rates)}
            lines.append(" ".join(f"{'-' if row[c] is None else row[c]:>12}" for c in cols))
        frac = s["routing"]["same_decode_worker_fraction"]
        lines.append(
            "same decode worker as the previous turn: " + ("-" if frac is None else f"{frac:.2f}")
        )
        leaks = [w for w in s["workers"] if not w["clean"]]
        lines.append("workers clean" if not leaks else f"LEAKS: {leaks}")
    return "\n".join(lines)


def _cmd_bench_multiturn(args: argparse.Namespace) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("bench multiturn needs httpx: pip install 'hybrid-pd[test]'", file=sys.stderr)
        return 2
    setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    try:
        result = bench_multiturn(
            args.model,
            args.conversations,
            args.turns,
            args.system_len,
            args.user_len,
            args.max_tokens,
            args.prefill_workers,
            args.decode_workers,
            setups,
            args.max_seconds,
            args.kv_memory,
            args.threads,
        )
    except ValueError as e:
        print(f"bench multiturn: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0 if result["no_leaks"] and result["errors"] == 0 else 1
