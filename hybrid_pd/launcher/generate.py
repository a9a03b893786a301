"""`hybrid-pd generate`: one prompt through one engine (its ranks on this host), or
through a prefill and a decode worker process with the KV moved over UCX."""

from __future__ import annotations

import argparse
import json

from hybrid_pd.api.sizes import HELD_STATE_ROWS_HELP
from hybrid_pd.launcher import preflight
from hybrid_pd.workers.flags import add_engine_flags, add_role_tp_flags


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with one engine (no server)")
    p.add_argument("--model", default="tiny", help="checkpoint folder, or `tiny` (built in)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    add_engine_flags(
        p,
        {
            "--kv-memory": "KV cache memory (bytes or 1GiB)",
            "--held-state-rows": HELD_STATE_ROWS_HELP,
            "--device": "torch device (default: torch's default)",
            "--threads": "torch threads per engine (default: its CPUs)",
            "--failure-policy": "decode's reaction to a failed KV pull (with --disaggregated)",
            "--tensor-parallel-size": "ranks of the engine, one process each, splitting heads "
            "and widths",
        },
    )
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
    add_role_tp_flags(
        p,
        {
            f"--{role}-tensor-parallel-size": f"with --disaggregated: the {role} worker's "
            "ranks (default --tensor-parallel-size)"
            for role in ("prefill", "decode")
        },
    )
    p.add_argument(
        "--disaggregated",
        action="store_true",
        help="prefill in one worker process, decode in another (KV over UCX)",
    )
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    preflight.check_model(args.model)
    preflight.check_device(args.device)
    if args.disaggregated:
        return _cmd_generate_pd(args)
    if args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size:
        raise ValueError(
            "--prefill-/--decode-tensor-parallel-size need --disaggregated "
            "(one engine takes --tensor-parallel-size)"
        )
    from hybrid_pd.engine.engine import Engine
    from hybrid_pd.engine.heap import frozen_heap
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.malloc import tune_malloc
    from hybrid_pd.engine.threads import set_torch_threads
    from hybrid_pd.engine.tiny import resolve_model
    from hybrid_pd.engine.tp.group import SINGLE
    from hybrid_pd.workers.settings import EngineSettings
    from hybrid_pd.workers.tp_ranks import RankGroup

    size = args.tensor_parallel_size
    set_torch_threads(args.threads, workers_on_this_host=size)
    tune_malloc()
    engine_config = EngineSettings.of(args).config()
    # ranks 1 .. size-1 as child processes; this process is rank 0
    ranks = None
    if size > 1:
        ranks = RankGroup(args.model, size, engine_config, args.device, args.threads)
    group = ranks.group if ranks is not None else SINGLE
    engine = None
    try:
        model, config, tokenizer = load_model(
            resolve_model(args.model), device=args.device, tp=group
        )
        engine = Engine(model, config, engine_config, tokenizer, tp=group)
        with frozen_heap():
            out = engine.generate([_prompt_ids(args, tokenizer)], _sampling(args))[0]
    finally:
        if ranks is not None:
            ranks.close(engine)
    result = {
        "token_ids": out.token_ids,
        "text": out.text if out.text is not None else "",
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_ids),
    }
    print(json.dumps(result) if args.json else result["text"])
    return 0


def _sampling(args: argparse.Namespace):
    from hybrid_pd.engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError("--prompt-ids takes integers separated by commas") from None
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer.json: use --prompt-ids")
    return tokenizer.encode(args.prompt)


def _cmd_generate_pd(args: argparse.Namespace) -> int:
    """One prefill and one decode worker process on 127.0.0.1; this process is the proxy."""
    import secrets

    from hybrid_pd.api.tokenizer import Tokenizer
    from hybrid_pd.api.wire import sampling_to_pb
    from hybrid_pd.engine.tiny import resolve_model
    from hybrid_pd.launcher.local import start_worker
    from hybrid_pd.proxy.worker_client import WorkerClient

    path = resolve_model(args.model)
    tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
    prompt = _prompt_ids(args, tokenizer)
    params = _sampling(args)
    sizes = {
        role: getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size
        for role in ("prefill", "decode")
    }
    common = [
        "--model",
        str(path),
        "--kv-memory",
        args.kv_memory,
        "--failure-policy",
        args.failure_policy,
        "--workers-on-host",
        str(sum(sizes.values())),  # every rank of both shares this machine's CPUs
    ]
    if args.threads:
        common += ["--threads", str(args.threads)]
    if args.device:
        common += ["--device", args.device]
    if args.held_state_rows is not None:
        common += ["--held-state-rows", str(args.held_state_rows)]
    secret = secrets.token_urlsafe(32)  # closed by default; it reaches them by environment
    workers = []
    try:
        tp = {r: ("--tensor-parallel-size", str(n)) for r, n in sizes.items()}
        workers.append(start_worker("prefill", *common, *tp["prefill"], secret=secret))
        peer = ("--peer", workers[0].address)  # the only prefill worker it may pull from
        workers.append(start_worker("decode", *common, *tp["decode"], *peer, secret=secret))
        prefill, decode = (WorkerClient(w.address, secret=secret) for w in workers)
        sampling = sampling_to_pb(params)
        first = prefill.prefill("cli-0", prompt, sampling)
        if first.finished:
            tokens, reason, transfer = [first.first_token], first.finish_reason, {}
        else:
            out = decode.generate("cli-0", prompt, sampling, first.kv_transfer_params)
            if out.error:
                raise RuntimeError(f"decode failed: {out.error}")
            tokens, reason, transfer = out.token_ids, out.finish_reason, out.transfer
            transfer["blocks"] = first.kv_transfer_params.num_blocks
        stats = [c.stats() for c in (prefill, decode)]
    finally:
        for w in workers:
            w.stop()
    text = tokenizer.decode(tokens) if tokenizer else ""
    result = {
        "token_ids": tokens,
        "text": text,
        "finish_reason": reason,
        "prompt_tokens": len(prompt),
        "transfer": transfer,
        "leaked_blocks": {s["role"]: s["num_blocks"] - 1 - s["free_blocks"] for s in stats},
    }
    print(json.dumps(result) if args.json else text)
    return 0
