"""Run one worker as a process: `python -m hybrid_pd.workers.main --role prefill ...`.

The process shell (flags, logging, signals, the line it prints) lives here; the worker it
runs is assembled from its roles by `hybrid_pd.roles` (this package imports no role: the
command line's entry at the bottom reaches the assembly, and nothing else here does).

Prints one JSON line ({"address": ..., "engine_id": ...}) on stdout when serving, then
serves until SIGTERM/SIGINT or until stdin closes (so a parent that dies takes it along).

The control-plane secret comes from `--secret` (visible in `ps`: avoid it), `--secret-file`
or the environment variable HYBRID_PD_SECRET, in that order of precedence.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable

from hybrid_pd.api.secret import SECRET_ENV, given_secret
from hybrid_pd.api.sizes import HELD_STATE_ROWS_HELP
from hybrid_pd.engine.heap import freeze_startup_heap
from hybrid_pd.engine.malloc import tune_malloc
from hybrid_pd.engine.threads import set_torch_threads
from hybrid_pd.workers.config import ROLES, WorkerConfig
from hybrid_pd.workers.flags import add_engine_flags, add_worker_flags, positive_int
from hybrid_pd.workers.settings import worker_config_from_args
from hybrid_pd.workers.worker import Worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybrid-pd-worker")
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    add_engine_flags(
        p,
        {
            "--held-state-rows": HELD_STATE_ROWS_HELP,
            "--threads": "torch intra-op threads (default: this process's CPUs / "
            "--workers-on-host)",
            "--tensor-parallel-size": "ranks of this worker's engine, one process each on "
            "this host (this is rank 0)",
        },
    )
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="tokens one engine step computes at most (a long prompt is prefilled in chunks "
        "of this size)",
    )
    p.add_argument(
        "--secret",
        default=None,
        help=f"control-plane secret (visible in ps: prefer --secret-file or ${SECRET_ENV})",
    )
    add_worker_flags(
        p,
        {
            "--secret-file": "read the control-plane secret from here",
            "--ucx-tls": "UCX transports, e.g. tcp,self",
            "--max-queued": "requests admitted but waiting for their first token; beyond: "
            "RESOURCE_EXHAUSTED",
        },
    )
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument(
        "--no-prefix-reuse-on-load",
        dest="reuse_prefix_on_load",
        action="store_false",
        help="decode role: pull a handed-over prompt's every block, even those this worker's "
        "prefix cache holds (default: pull only what it lacks)",
    )
    p.add_argument(
        "--no-kv-scatter-gather",
        dest="kv_scatter_gather",
        action="store_false",
        help="decode role: pull each run of blocks as its own UCX message (default: a few "
        "scatter-gather messages per request)",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        help="decode role: a prefill worker (host:port) it may pull KV from; repeatable "
        "(a proxy adds the ones it knows)",
    )
    p.add_argument(
        "--workers-on-host",
        type=int,
        default=1,
        help="engine processes sharing this host's CPUs (sets the default --threads)",
    )
    p.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    return p.parse_args(argv)


def main(argv: list[str] | None, build: Callable[[WorkerConfig], Worker]) -> int:
    """Serve one worker, made by `build` (the roles' assembly) from the flags in `argv`,
    until SIGTERM / SIGINT (or stdin closes, with --watch-stdin); the exit status."""
    args = parse_args(argv)
    try:
        secret = given_secret(args.secret, args.secret_file)
    except ValueError as e:
        print(f"hybrid-pd-worker: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    set_torch_threads(args.threads, args.workers_on_host)
    tune_malloc()
    config = worker_config_from_args(args, secret)
    worker = build(config)
    freeze_startup_heap()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    if args.watch_stdin:
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print(
        json.dumps({"address": worker.address, "engine_id": worker.engine_id, "role": args.role}),
        flush=True,
    )
    done.wait()
    worker.close()
    return 0


if __name__ == "__main__":
    # The command line's entry, kept at this path: the one place under workers/ that
    # reaches the roles, and only when run as a program.
    from hybrid_pd.roles import build_worker

    sys.exit(main(None, build_worker))
