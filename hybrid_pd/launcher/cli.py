"""`hybrid-pd` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from hybrid_pd import __version__
from hybrid_pd.api.sizes import HELD_STATE_ROWS_HELP
from hybrid_pd.launcher import preflight
from hybrid_pd.launcher.console import (
    LOG_LEVELS,
    check_port,
    configure_logging,
    forward_ray_logs_plainly,
)
from hybrid_pd.launcher.generate import add_generate
from hybrid_pd.launcher.lazy_parser import LazyParser
from hybrid_pd.workers.flags import (
    add_engine_flags,
    add_role_tp_flags,
    add_worker_flags,
)

logger = logging.getLogger("hybrid_pd.launcher.cli")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan the KV cache of a model (groups, waste, capacity)")
    p.add_argument(
        "config",
        nargs="?",
        help="config.json, a checkpoint folder, or a reference name (see --list)",
    )
    p.add_argument("--list", action="store_true", help="list the built-in reference configs")
    p.add_argument("--kv-memory", default="40GiB", help="KV cache memory (bytes or 40GiB)")
    p.add_argument("--block-size", type=int, default=None, help="fix the attention block size")
    p.add_argument(
        "--max-block-size",
        type=int,
        default=64,
        help="largest attention block size the search tries (default 64)",
    )
    p.add_argument(
        "--block-align",
        type=int,
        default=1,
        help="tried block sizes are multiples of this (16 for FlashAttention)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="request length to size for (default: the model's maximum)",
    )
    p.add_argument("--dtype", default=None, help="KV dtype (default: the model's dtype)")
    p.add_argument(
        "--no-hma",
        action="store_true",
        help="report the plan with the hybrid manager off as the main result",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from hybrid_pd.api.sizes import parse_bytes
    from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
    from hybrid_pd.kvcache.planner import PlanOptions, plan_report
    from hybrid_pd.kvcache.reference_configs import (
        REFERENCE_CONFIGS,
        reference_config,
        short_name,
    )

    if args.list:
        for name in REFERENCE_CONFIGS:
            print(short_name(name))
        return 0
    if not args.config:
        raise ValueError("give a config.json, a checkpoint folder or a reference name")
    source = args.config
    if not os.path.exists(source) and (ref := reference_config(source)) is not None:
        source = ref

    opts = PlanOptions(
        kv_memory_bytes=parse_bytes(args.kv_memory),
        block_size=args.block_size,
        max_block_size=args.max_block_size,
        block_align=args.block_align,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
    )
    report = plan_report(cache_spec_from_config(source), opts)
    if args.no_hma:
        off = report["no_hma"]
        hma = {k: v for k, v in report.items() if k in off or k == "no_hma"}
        report = {**{k: v for k, v in report.items() if k not in hma}, **off, "hma": hma}
        report["no_hma"] = off
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_format_plan(report))
    return 1 if "error" in report else 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def _format_plan(r: dict[str, Any]) -> str:
    lines = [
        f"model {r['architecture']}: {r['num_cache_layers']} cache layers, "
        f"max_model_len {r['max_model_len']}, KV memory {_gib(r['kv_memory_bytes'])}",
    ]
    if "error" in r:
        return "\n".join([*lines, f"error: {r['error']}"])
    lines.append(f"groups ({r['strategy']}):")
    lines.append(f"  {'ids':>7} {'type':<15} {'layers':>6} {'padding':>7} {'block':>5}  layers")
    groups = r["groups"]
    i = 0
    while i < len(groups):  # collapse runs of groups that look the same
        g, j = groups[i], i
        same = ("type", "num_layers", "padding_layers")
        while j + 1 < len(groups) and all(groups[j + 1][k] == g[k] for k in same):
            j += 1
        ids = str(g["group_id"]) if i == j else f"{g['group_id']}-{groups[j]['group_id']}"
        names = [n for h in groups[i : j + 1] for n in h["layers"]]
        shown = ", ".join(names[:3]) + (f" ... ({len(names)})" if len(names) > 3 else "")
        lines.append(
            f"  {ids:>7} {g['type']:<15} {g['num_layers']:>6} "
            f"{g['padding_layers']:>7} {g['block_size']:>5}  {shown}"
        )
        i = j + 1
    cols = [("hybrid-pd", r), ("vLLM-style", r["vllm_style"]), ("HMA off", r["no_hma"])]
    lines.append("")
    lines.append(f"  {'':<26}" + "".join(f"{name:>16}" for name, _ in cols))
    rows = [
        ("block size (tokens)", "block_size", str),
        ("page size (bytes)", "page_size_bytes", str),
        ("KV cache groups", "num_groups", str),
        ("padding waste", "padding_waste", lambda v: f"{100 * v:.3f}%"),
        ("bytes per request", "bytes_per_request", _gib),
        ("max concurrent requests", "max_concurrent_requests", str),
    ]
    for label, key, fmt in rows:
        cells = [fmt(c[key]) if key in c else "n/a" for _, c in cols]
        lines.append(f"  {label:<26}" + "".join(f"{c:>16}" for c in cells))
    if "error" in r["no_hma"]:
        lines.append(f"HMA off: {r['no_hma']['error']}")
    return "\n".join(lines)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="prefill/decode pools on Ray behind an OpenAI-style proxy")
    p.add_argument("--config", help="YAML file with the settings below (flags override it)")
    p.add_argument("--address", help="join this Ray cluster (default: embedded local Ray)")
    p.add_argument("--prefill", type=int, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, help="decode workers (default 1)")
    p.add_argument("--model", help="checkpoint folder or `tiny` (default)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        dest="served_model_names",
        metavar="NAME",
        help="ids clients pass as `model` (the first is listed; default: `tiny`, or the "
        "checkpoint folder's name)",
    )
    p.add_argument(
        "--engine",
        choices=("hybrid-pd", "vllm"),
        help="the workers' engine: hybrid-pd (default) or vllm (vLLM OpenAI servers running "
        "hybrid-pd's connector)",
    )
    p.add_argument(
        "--vllm-python",
        help="engine vllm: a Python that has vLLM (default: $HYBRID_PD_VLLM_PYTHON, else this one)",
    )
    p.add_argument("--dtype", help="engine vllm: compute dtype (default: the checkpoint's)")
    p.add_argument("--host", help="proxy address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="proxy port (default 8000; 0 picks one)")
    add_engine_flags(
        p,
        {
            "--kv-memory": "KV memory per worker (default 1GiB)",
            "--held-state-rows": f"per worker: {HELD_STATE_ROWS_HELP}",
            "--device": "torch device of the workers (e.g. cuda)",
            "--threads": "torch threads per worker",
        },
        defaults=False,  # ServeConfig's (and a --config file's) apply where not given
        only=("--kv-memory", "--held-state-rows", "--device", "--threads", "--failure-policy"),
    )
    p.add_argument(
        "--secret",
        help="shared secret for all worker RPCs (visible in `ps`: prefer --secret-file or "
        "HYBRID_PD_SECRET); embedded mode makes one when none is given",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="join a cluster (--address) without a secret: worker RPCs open to the network",
    )
    p.add_argument(
        "--min-prefill-tokens", type=int, help="shorter prompts skip the prefill pool (default 32)"
    )
    add_worker_flags(
        p,
        {
            "--secret-file": "read the shared secret from this file",
            "--ucx-tls": "UCX transports for KV transfers (e.g. tcp,self)",
            "--max-queued": "per worker: requests waiting for their first token before it "
            "refuses more (default 256)",
        },
        defaults=False,
    )
    p.add_argument(
        "--max-pending",
        type=int,
        help="proxy: requests held at once; past it new ones get 429 (default 1024)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        help="proxy: how long a request waits for a worker with room before 429 (default 30)",
    )
    p.add_argument(
        "--max-fallback-prefills",
        type=int,
        help="proxy: prefills run on decode workers at once while no prefill worker is up "
        "(default 4)",
    )
    tp_help = "ranks of {} worker's engine, one process each on its node ({})"
    add_engine_flags(
        p,
        {"--tensor-parallel-size": tp_help.format("every", "default 1")},
        defaults=False,
        only=("--tensor-parallel-size",),
    )
    add_role_tp_flags(
        p,
        {
            f"--{role}-tensor-parallel-size": tp_help.format(
                f"each {role}", "default --tensor-parallel-size"
            )
            for role in ("prefill", "decode")
        },
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        help="proxy: times one stream may move to another decode worker (default 3)",
    )
    p.add_argument(
        "--kv-routing",
        choices=("prefix", "load"),
        help="proxy: prefix (KV-aware: the workers likely to cache a request's longest "
        "prefix, load permitting) or load (least loaded only); default prefix",
    )
    p.add_argument(
        "--overlap-transfer",
        action="store_true",
        default=None,
        help="proxy: "
        + "start the decode leg beside the prefill and pull attention blocks as their "
        "chunks finish, instead of after the whole prompt (engine hybrid-pd)",
    )
    _add_log_flags(p)
    p.set_defaults(func=_cmd_serve)


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    """`--log-level` and `-v` on a server command (`-v` is also taken before the command)."""
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help="logging of the launcher, the proxy (its access log at info) and the workers "
        "(default info)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,  # keeps a `-v` given before the command
        help="debug logging (--log-level debug)",
    )


#: `serve`'s exit status when a worker pool is lost for good (the supervisor gave up).
EXIT_POOL_LOST = 3


def _cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses
    import signal
    import threading

    from hybrid_pd.launcher.serve import Deployment, Interrupted, ServeConfig, wait_ready

    keys = (
        "address",
        "prefill",
        "decode",
        "model",
        "served_model_names",
        "host",
        "port",
        "kv_memory",
        "held_state_rows",
        "secret",
        "secret_file",
        "insecure",
        "device",
        "failure_policy",
        "min_prefill_tokens",
        "threads",
        "ucx_tls",
        "max_queued",
        "max_pending",
        "queue_timeout_s",
        "max_fallback_prefills",
        "max_migrations",
        "kv_routing",
        "overlap_transfer",
        "log_level",
        "engine",
        "vllm_python",
        "dtype",
        "tensor_parallel_size",
        "prefill_tensor_parallel_size",
        "decode_tensor_parallel_size",
    )
    overrides = {k: getattr(args, k) for k in keys}
    if args.log_level is None and args.verbose:
        overrides["log_level"] = "debug"
    if args.config:
        config = ServeConfig.from_yaml(args.config, **overrides)
        if args.secret is not None or args.secret_file is not None:
            # A secret on the command line replaces the file's, whichever form each takes.
            config = dataclasses.replace(config, secret=args.secret, secret_file=args.secret_file)
    else:
        config = ServeConfig(**{k: v for k, v in overrides.items() if v is not None})
    config = config.resolved()  # refuse a cluster without a secret before starting anything
    configure_logging(config.log_level)
    check_port(config.host, config.port)  # a clear error now, not after Ray and the workers
    preflight.check_model(config.model, engine=config.engine)
    if config.engine == "vllm":
        preflight.check_python(config.resolved_vllm_python())
    elif config.address is None:  # a cluster's workers may have devices this machine lacks
        preflight.check_device(config.device)
    forward_ray_logs_plainly()
    done = threading.Event()

    def stop(sig: int, _frame) -> None:
        if not done.is_set():
            logger.info("%s received: shutting down", signal.Signals(sig).name)
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        deployment = Deployment(config, on_failure=lambda _reason: done.set(), interrupt=done)
    except Interrupted as e:
        logger.info("%s; stopped", e)
        return 0
    try:
        wait_ready(deployment.url, abort=done)
        if not done.is_set():
            print(
                f"hybrid-pd serving {config.model} at {deployment.url}/v1 "
                f"({config.prefill} prefill, {config.decode} decode workers)",
                flush=True,
            )
        done.wait()
        if deployment.failure is not None:
            print(f"hybrid-pd serve: error: {deployment.failure}", file=sys.stderr, flush=True)
            return EXIT_POOL_LOST
    finally:
        deployment.close()
    return 0


def _bench_commands(parser: argparse.ArgumentParser) -> None:
    """`bench`'s subcommands, filled in when `hybrid-pd bench` is parsed: no other command
    imports the bench wing."""
    from hybrid_pd.bench.cli import add_bench_commands

    add_bench_commands(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-pd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hybrid-pd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    _add_plan(sub)
    add_generate(sub)
    _add_serve(sub)
    from hybrid_pd.proxy.__main__ import add_arguments, run

    p = sub.add_parser("proxy", help="the OpenAI front door alone, in front of running workers")
    add_arguments(p)
    p.set_defaults(func=run)
    sub.add_parser("bench", help="run a benchmark and print its figures", fill=_bench_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Servers say what they do (startup, access log) at info; other commands only warn.
    quiet = "info" if args.command in ("serve", "proxy") else "warning"
    configure_logging(getattr(args, "log_level", None) or ("debug" if args.verbose else quiet))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"hybrid-pd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
