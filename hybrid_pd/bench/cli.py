"""`hybrid-pd bench ...`: benchmarks that print JSON figures. `add_bench_commands` fills the
`bench` parser with every benchmark's subcommand; launcher/cli.py calls it only when
`hybrid-pd bench` is what is parsed, so no other command imports the bench wing."""

from __future__ import annotations

import argparse
import json

HELP = "run a benchmark and print its figures"


def add_bench(sub: argparse._SubParsersAction) -> None:
    """A complete `bench` subcommand under `sub` (for callers building their own parser)."""
    add_bench_commands(sub.add_parser("bench", help=HELP))


def add_bench_commands(p: argparse.ArgumentParser) -> None:
    """Every benchmark as a subcommand of `p` (the `bench` parser); each sets `func`."""
    from hybrid_pd.bench.engine import add_engine_parser
    from hybrid_pd.bench.kvcache import add_kvcache_parser
    from hybrid_pd.bench.load import add_load_parser
    from hybrid_pd.bench.multiturn import add_multiturn_parser
    from hybrid_pd.bench.overlap import add_overlap_parser
    from hybrid_pd.bench.proxy import add_proxy_parser
    from hybrid_pd.bench.serve import add_serve_parser
    from hybrid_pd.bench.startup import add_startup_parser
    from hybrid_pd.bench.tp import add_tp_parser
    from hybrid_pd.bench.vllm_pd import add_bench_vllm

    bsub = p.add_subparsers(dest="bench", required=True)
    add_kvcache_parser(bsub)
    add_engine_parser(bsub)
    add_bench_vllm(bsub)
    _add_transfer_parser(bsub)
    add_serve_parser(bsub)
    add_load_parser(bsub)
    add_proxy_parser(bsub)
    add_multiturn_parser(bsub)
    add_overlap_parser(bsub)
    add_tp_parser(bsub)
    add_startup_parser(bsub)


def _add_transfer_parser(bsub: argparse._SubParsersAction) -> None:
    """`bench transfer`'s flags, here rather than in `bench.transfer`, which imports torch
    and the connector: parsing any bench command stays light."""
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
    t.add_argument(
        "--two-sided",
        dest="one_sided",
        action="store_false",
        help="the prefill side sends (the hand-over before one-sided reads)",
    )
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_cmd_bench_transfer)


def _cmd_bench_transfer(args: argparse.Namespace) -> int:
    from hybrid_pd.bench.transfer import bench_transfer

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
        one_sided=args.one_sided,
    )
    print(json.dumps(result, indent=2) if args.json else _transfer_summary(result))
    return 0


def _transfer_summary(result: dict) -> str:
    lines = [
        f"{result['model']}: block {result['block_size']}, page "
        f"{result['page_size_bytes']} B, {result['num_groups']} groups, churn {result['churn']}"
    ]
    for r in result["runs"]:
        lines.append(
            f"{r['tokens']:>6} tokens {r['bytes'] / 2**20:9.1f} MiB "
            f"{r['messages_per_request']:>7} msgs/req  KV {r['kv_gb_per_s']:6.2f} GB/s  raw "
            f"{r['raw_gb_per_s']:6.2f} GB/s  ratio {r['ratio']:.2f}"
        )
    return "\n".join(lines)
