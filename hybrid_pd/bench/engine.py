"""`hybrid-pd bench engine`: prefill and decode tokens/s of our engine next to transformers'
generate in the same process, or with `--peer vllm` next to vLLM's offline engine
(`bench.peer`)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hybrid_pd.api.sizes import held_state_rows_arg


def add_engine_parser(bsub: argparse._SubParsersAction) -> None:
    e = bsub.add_parser(
        "engine",
        help="prefill/decode tokens/s next to transformers, or next to vLLM (--peer vllm)",
        description="Prefill and decode tokens/s of our engine next to transformers' generate "
        "(same process), or with `--peer vllm` next to vLLM's offline engine on the same "
        "checkpoint, run under vLLM's own Python and alternated rep by rep: e.g. "
        "`hybrid-pd bench engine --model PATH --peer vllm --peer-python .venv-vllm/bin/python "
        "--batch-sizes 1,8,32 --threads 1 --json` (see docs/vllm.md).",
    )
    e.add_argument(
        "--model",
        default="tiny",
        help="tiny, a checkpoint folder, or a real shape built from a published config "
        "(random weights): granite-4.0-h-350m-like, gemma-3-270m-like, qwen3.5-0.8b-like",
    )
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
    e.add_argument(
        "--peer-compiled",
        action="store_true",
        help="--peer: vLLM as it starts by default (its torch.compile graphs), not eager",
    )
    e.add_argument(
        "--decode-by-difference",
        action="store_true",
        help="--peer: also run each batch to its first token alone and report decode as the "
        "whole run's time less that (*_by_difference: independent of when a side reports "
        "first tokens)",
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

    from hybrid_pd.bench.real_shapes import resolve_bench_model
    from hybrid_pd.engine.engine import Engine, EngineConfig
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.malloc import tune_malloc
    from hybrid_pd.engine.sampling import SamplingParams
    from hybrid_pd.engine.threads import set_torch_threads

    threads = set_torch_threads(threads)
    tune_malloc()
    path = resolve_bench_model(model_name)
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
    runs = "\n".join(", ".join(f"{k}={v}" for k, v in r.items()) for r in result["runs"])
    print(json.dumps(result, indent=2) if args.json else runs)
    return 0


def _cmd_bench_engine_peer(args: argparse.Namespace, sizes: list[int]) -> int:
    from hybrid_pd.bench.peer import bench_engine_peer, parse_env, peer_python, summary

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
        peer_compiled=args.peer_compiled,
        decode_by_difference=args.decode_by_difference,
    )
    print(json.dumps(result, indent=2) if args.json else summary(result))
    return 0
