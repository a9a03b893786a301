"""Run the proxy alone in front of workers that are already serving:
`python -m hybrid_pd.proxy --decode HOST:PORT [--prefill HOST:PORT ...]` (or `hybrid-pd proxy`).

The process loads no torch and no model: what it serves it learns from the workers."""

from __future__ import annotations

import argparse
import sys

from hybrid_pd.api.logs import configure_logging
from hybrid_pd.api.secret import given_secret
from hybrid_pd.proxy.config import KV_ROUTING, ProxyConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="*", default=[], metavar="HOST:PORT", help="prefill workers")
    p.add_argument("--decode", nargs="+", required=True, metavar="HOST:PORT", help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks one)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=(),
        dest="served_model_names",
        metavar="NAME",
        help="ids clients pass as `model` (default: the workers' model)",
    )
    p.add_argument(
        "--tokenizer",
        help="folder of tokenizer.json on this host (default: the folder the workers report)",
    )
    p.add_argument("--secret-file", help="the workers' control-plane secret, from this file")
    p.add_argument("--min-prefill-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, help="a lower limit than the workers' own")
    p.add_argument(
        "--kv-routing",
        choices=KV_ROUTING,
        default="prefix",
        help="prefix: a request goes to the workers likely to cache its longest prefix "
        "(a conversation's next turn where its last ran), load permitting; load: the least "
        "loaded only (default prefix)",
    )
    p.add_argument(
        "--overlap-transfer",
        action="store_true",
        help="start the decode leg beside the prefill and pull attention blocks as their "
        "chunks finish, instead of after the whole prompt (engine hybrid-pd)",
    )
    p.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="logging, the access log included (default info)",
    )


def run(args: argparse.Namespace) -> int:
    from hybrid_pd.proxy.server import run_proxy

    config = ProxyConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_names),
        model_path=args.tokenizer,
        prefill_addresses=tuple(args.prefill),
        decode_addresses=tuple(args.decode),
        secret=given_secret(None, args.secret_file),
        min_prefill_tokens=args.min_prefill_tokens,
        max_model_len=args.max_model_len,
        kv_routing=args.kv_routing,
        overlap_transfer=args.overlap_transfer,
    )
    run_proxy(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_pd.proxy", description=__doc__)
    add_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    configure_logging(args.log_level or ("debug" if args.verbose else "info"))
    try:
        return run(args)
    except ValueError as e:
        print(f"hybrid-pd proxy: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
