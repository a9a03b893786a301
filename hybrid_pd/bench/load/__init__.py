"""`hybrid-pd bench load`: the whole service under load and under faults.

The bench starts `hybrid-pd serve` itself, as a subprocess, in a private network namespace
(`unshare -n`, loopback up, everything on 127.0.0.1 in there; the load generator re-executes
itself inside the same namespace), once per mode:

- `pd`: one prefill and one decode worker;
- `aggregated`: `--prefill 0 --decode 1` (every request runs wholly on one worker).

Each scenario (`scenarios.py`) gets a fresh `serve`; the load is a seeded mix of completions
and chat, streaming and not, prompts of 10-2000 random characters, max_tokens 1-64,
temperature 0 (`mix.py`, which also says how every request is accounted for). `procs.py`
holds the processes and the namespace, `state.py` the check of the pool after each scenario.

This module is the command: its flags, its table, its entry point."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybrid_pd.bench.load.options import (
    FULL,
    MODES,
    QUICK,
    SCENARIOS,
    LoadOptions,
    options_from_args,
)
from hybrid_pd.bench.load.procs import run_in_netns
from hybrid_pd.bench.load.scenarios import run_bench


def add_load_parser(bsub: argparse._SubParsersAction) -> None:
    d = LoadOptions
    s = bsub.add_parser(
        "load", help="the whole service under load and faults (kills a worker mid-run)"
    )
    s.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    s.add_argument("--modes", default=",".join(MODES), help="comma-separated: pd, aggregated")
    s.add_argument("--model", default=d.model, help="checkpoint folder or `tiny` (built in)")
    levels = ",".join(map(str, FULL["concurrency"]))
    s.add_argument("--requests", type=int, help=f"mixed: requests per level (default {d.requests})")
    s.add_argument("--concurrency", help=f"mixed: comma-separated levels (default {levels})")
    s.add_argument(
        "--kill-requests", type=int, help=f"kill scenarios: requests (default {d.kill_requests})"
    )
    s.add_argument(
        "--kill-concurrency", type=int, help=f"kill scenarios (default {d.kill_concurrency})"
    )
    s.add_argument(
        "--small-kv-requests", type=int, help=f"small_kv: requests (default {d.small_kv_requests})"
    )
    s.add_argument(
        "--small-kv-concurrency", type=int, help=f"small_kv (default {d.small_kv_concurrency})"
    )
    s.add_argument(
        "--small-kv-memory", default=d.small_kv_memory, help="small_kv: KV memory per worker"
    )
    s.add_argument("--small-kv-prompt-chars", type=int, default=d.small_kv_prompt_chars)
    s.add_argument(
        "--kv-memory", default=d.kv_memory, help="KV memory per worker (other scenarios)"
    )
    s.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    s.add_argument(
        "--request-timeout-s", type=float, default=d.request_timeout_s, help="per request"
    )
    s.add_argument(
        "--time-limit-s",
        type=float,
        default=d.time_limit_s,
        help="the whole bench stops by itself after this and reports what it has",
    )
    s.add_argument(
        "--settle-s", type=float, default=d.settle_s, help="wait this long at most for an idle pool"
    )
    s.add_argument(
        "--verify", type=int, help=f"mixed: requests sent again and compared ({d.verify})"
    )
    s.add_argument("--seed", type=int, default=d.seed)
    quick = f"({QUICK['requests']} requests, c={QUICK['concurrency'][0]})"
    s.add_argument("--quick", action="store_true", help=f"small counts for smoke runs {quick}")
    s.add_argument(
        "--no-netns",
        action="store_true",
        help="run on this machine's loopback instead of a private network namespace",
    )
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.set_defaults(func=_cmd_bench_load)


def _fmt(v: Any) -> str:
    return "-" if v is None else str(v)


#: (header, key) of the table's columns; latencies in ms.
COLUMNS = (
    ("conc", "concurrency"),
    ("sent", "sent"),
    ("done", "completed"),
    ("failed", "failed"),
    ("lost", "lost"),
    ("req/s", "requests_per_s"),
    ("tok/s", "output_tokens_per_s"),
    ("TTFT p50", "ttft_ms_p50"),
    ("TTFT p99", "ttft_ms_p99"),
    ("e2e p50", "e2e_ms_p50"),
    ("e2e p99", "e2e_ms_p99"),
)


def _notes(r: dict[str, Any]) -> list[str]:
    """What a scenario found beyond its table rows."""
    notes = []
    if "verify" in r:
        v = r["verify"]
        notes.append(f"verify: {v['mismatched']}/{v['compared']} mismatched")
    if "kill" in r:
        k, vs = r["kill"], r["vs_mixed"]
        notes.append(
            f"killed {k['role']} pid {k['pid']} after {k.get('after_requests')} "
            f"(ok {k.get('killed')}); recovery {_fmt(r['recovery_s'])} s "
            f"(by {_fmt(r.get('recovered_by'))}), worker back "
            f"{_fmt(r['worker_back_s'])} s; vs mixed {vs['mismatched']}/"
            f"{vs['compared']} mismatched"
        )
    if "max_e2e_s" in r:
        notes.append(
            f"all finished {r['all_finished']}, max e2e {_fmt(r['max_e2e_s'])} s, max "
            f"TTFT {_fmt(r['max_ttft_s'])} s, near a timeout {r['near_timeout']}"
        )
    notes.append(f"leaked blocks {r.get('leaked_blocks')} (clean {r.get('clean')})")
    return notes


def format_table(result: dict[str, Any]) -> str:
    lines = []
    for mode, scenarios in result.items():
        if mode == "meta":
            continue
        lines.append(f"{mode}:")
        lines.append(f"  {'scenario':<13}" + "".join(f"{h:>10}" for h, _ in COLUMNS) + "  (ms)")
        for name, r in scenarios.items():
            if "skipped" in r or "error" in r:
                lines.append(f"  {name:<13}  {r.get('skipped') or 'ERROR ' + r['error'][:300]}")
                continue
            for row in r.get("levels") or [r]:
                cells = "".join(f"{_fmt(row.get(k)):>10}" for _, k in COLUMNS)
                lines.append(f"  {name:<13}{cells}")
                if row["failed_by_kind"]:
                    lines.append(f"  {'':<13}  failed by kind: {row['failed_by_kind']}")
            lines += [f"  {'':<13}  {note}" for note in _notes(r)]
    meta = result.get("meta", {})
    if meta.get("cross_mode"):
        cm = meta["cross_mode"]
        lines.append(f"pd vs aggregated: {cm['mismatched']}/{cm['compared']} texts differ")
    lines.append(
        f"elapsed {meta.get('elapsed_s')} s (time limit hit: {meta.get('time_limit_hit')})"
    )
    return "\n".join(lines)


def _cmd_bench_load(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    if args.no_netns:
        result = run_bench(opts)
        result["meta"]["netns"] = False
    else:
        try:
            result = run_in_netns(opts)
        except RuntimeError as e:
            print(f"hybrid-pd bench load: error: {e}", file=sys.stderr)
            return 1
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    errors = [s for k, m in result.items() if k != "meta" for s in m.values() if "error" in s]
    return 1 if errors else 0
