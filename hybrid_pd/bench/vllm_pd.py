"""`hybrid-pd bench vllm`: P/D between vLLM servers through hybrid-pd's connector and through
vLLM's own NixlConnector, side by side on one machine.

For each connector a prefill server and a decode server start (vLLM's CPU build: prefill on
one half of the CPUs, decode on the other). Each request goes the way vLLM's disaggregation
examples send it: the prompt to prefill with `do_remote_decode` and max_tokens 1, then the
same request to decode with the kv_transfer_params it returned, and decode's reply is the
answer. With hybrid-pd decode continues from the prefill's first token and the exact state
after the prompt, and its reply starts with that token; NIXL's decode produces every token
itself (for Mamba/GDN layers it recomputes the last prompt token).

Figures per connector: how many outputs equal one vLLM instance's (greedy token ids) and how
long the agreeing prefix is, and the hand-off's cost as the client sees it: the decode
request's time to its first streamed token. Connectors alternate request by request, over
`--reps` repetitions, so machine noise falls on both alike."""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybrid_pd.bench.peer_vllm import agreeing_tokens
from hybrid_pd.bench.vllm_handoff import handoff_figures, timelines
from hybrid_pd.bench.vllm_servers import Server, cpu_halves, start_all
from hybrid_pd.connector import timeline
from hybrid_pd.workers.vllm_server import free_port

CONNECTORS = ("hybrid-pd", "nixl")


def add_bench_vllm(bsub: argparse._SubParsersAction) -> None:
    v = bsub.add_parser("vllm", help="P/D between vLLM servers: hybrid-pd's connector vs NIXL")
    v.add_argument("--model", required=True, help="checkpoint folder vLLM can serve")
    v.add_argument("--dtype", default="float32")
    v.add_argument(
        "--python",
        default=os.environ.get("HYBRID_PD_VLLM_PYTHON", ".venv-vllm/bin/python"),
        help="the interpreter that has vLLM (and nixl, for the NIXL side)",
    )
    v.add_argument("--connectors", default=",".join(CONNECTORS))
    v.add_argument("--prompts", type=int, default=6)
    v.add_argument("--min-len", type=int, default=32)
    v.add_argument("--max-len", type=int, default=800)
    v.add_argument(
        "--prompt-lens",
        default="",
        help="comma-separated prompt lengths in tokens (e.g. 128,2048,16384): --prompts "
        "prompts of each length instead of random lengths in [--min-len, --max-len]",
    )
    v.add_argument("--max-tokens", type=int, default=16)
    v.add_argument("--reps", type=int, default=2)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--vocab", type=int, default=None, help="draw prompt ids below this")
    v.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    v.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for every server (repeatable)"
    )
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=_cmd_bench_vllm)


def _nixl_config() -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
    }


class _Pair:
    """One connector's prefill and decode servers."""

    def __init__(self, name: str, model: Path, args, log_dir: Path, env: dict) -> None:
        self.name = name
        if name == "hybrid-pd":
            control = free_port()
            # the servers stamp each hand-off's stages in their logs (`connector.timeline`)
            env = {**env, "HYBRID_PD_SECRET": secrets.token_urlsafe(24), timeline.ENV: "1"}
            sides = (
                dict(role="kv_producer", extra={"control_port": control}, env=env),
                dict(role="kv_consumer", extra={"peers": [f"127.0.0.1:{control}"]}, env=env),
            )
        elif name == "nixl":
            sides = tuple(
                dict(
                    kv_transfer_config=_nixl_config(),
                    env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                )
                for _ in range(2)
            )
        else:
            raise ValueError(f"unknown connector {name!r} (known: {', '.join(CONNECTORS)})")
        self.prefill, self.decode = (
            Server(
                model,
                log_dir / f"{name}-{side}.log",
                cpus=cpus,
                dtype=args.dtype,
                python=args.python,
                max_model_len=args.max_model_len,
                kv_cache_bytes=args.kv_cache_bytes,
                **kw,
            )
            for side, cpus, kw in zip(("prefill", "decode"), cpu_halves(), sides, strict=True)
        )

    def wait_ready(self) -> None:
        start_all([self.prefill, self.decode])
        for server in (self.prefill, self.decode):
            server.client.timeout = 900.0  # a 16k-token prompt's prefill on a loaded CPU

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()

    def pause(self) -> None:
        self.prefill.pause()
        self.decode.pause()

    def resume(self) -> None:
        self.prefill.resume()
        self.decode.resume()

    def run(self, body: dict) -> dict[str, Any]:
        t0 = time.perf_counter()
        pre = self.prefill.complete(
            {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        prefill_s = time.perf_counter() - t0
        params = pre.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"{self.name}: the prefill server returned no kv_transfer_params")
        # as vLLM's routers do: the prefill's reply is dropped, decode's carries every token
        ids, ttft, total = self.decode.stream_timed({**body, "kv_transfer_params": params})
        hid = (params.get("hybrid_pd") or {}).get("request_id") or params.get(
            "remote_request_id", ""
        )
        return {
            "ids": ids,
            "prefill_s": prefill_s,
            "decode_ttft_s": ttft,
            "decode_s": total,
            "handoff_id": hid,
        }


def _public(row: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "ids"}


def bench_vllm(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model)
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} is not a checkpoint folder (no config.json)")
    names = [c.strip() for c in args.connectors.split(",") if c.strip()]
    env = dict(kv.split("=", 1) for kv in args.env)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.vocab is None:
        args.vocab = int(json.loads((model / "config.json").read_text()).get("vocab_size", 256))
    rng = random.Random(args.seed)
    if args.prompt_lens:
        fixed = [int(n) for n in args.prompt_lens.split(",") if n.strip()]
        lengths = [n for n in fixed for _ in range(args.prompts)]
    else:
        lengths = [rng.randrange(args.min_len, args.max_len + 1) for _ in range(args.prompts)]
    # room for the longest prompt and its tokens; KV for two such requests at once
    args.max_model_len = max(1024, max(lengths) + args.max_tokens + 16)
    args.kv_cache_bytes = max(64 << 20, args.max_model_len * (16 << 10))
    prompts = [[rng.randrange(3, args.vocab - 1) for _ in range(n)] for n in lengths]
    base = {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}

    pairs = [_Pair(n, model, args, log_dir, env) for n in names]
    try:
        for p in pairs:
            p.wait_ready()
        served = pairs[0].decode.client.get("/v1/models").json()["data"][0]["id"]
        base["model"] = served
        # One vLLM instance (a decode server, no kv_transfer_params) is the reference.
        refs = [
            pairs[0].decode.complete({**base, "prompt": q, "max_tokens": args.max_tokens})[
                "choices"
            ][0]["token_ids"]
            for q in prompts
        ]
        rows: dict[str, list[dict]] = {n: [] for n in names}
        for rep in range(args.reps):
            for i, q in enumerate(prompts):
                order = pairs if (rep + i) % 2 == 0 else pairs[::-1]
                for p in order:
                    # The other connectors' servers share these cores: paused, their
                    # background threads (NIXL's progress thread polls) take no CPU.
                    for other in pairs:
                        if other is not p:
                            other.pause()
                    try:
                        r = p.run({**base, "prompt": q, "max_tokens": args.max_tokens})
                    finally:
                        for other in pairs:
                            other.resume()
                    r.update(prompt_len=len(q), rep=rep, agree=agreeing_tokens(r["ids"], refs[i]))
                    r["exact"] = r["ids"] == refs[i]
                    rows[p.name].append(r)
        # What each decode server says it received (counters and histogram sums/counts).
        transfer = {
            p.name: {
                k: v
                for k, v in p.decode.metrics(("hybrid_pd_kv_", "vllm:nixl_")).items()
                if k.endswith(("_total", "_sum", "_count"))
            }
            for p in pairs
        }
    finally:
        for p in pairs:
            p.stop()
    stamps = timelines([p.prefill.log for p in pairs] + [p.decode.log for p in pairs])

    out: dict[str, Any] = {
        "model": str(model),
        "dtype": args.dtype,
        "prompt_lens": lengths,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "log_dir": str(log_dir),
        "connectors": {},
    }
    for name, rs in rows.items():
        out["connectors"][name] = {
            "requests": len(rs),
            "exact": sum(r["exact"] for r in rs),
            "mean_agreeing_tokens": round(statistics.mean(r["agree"] for r in rs), 2),
            "decode_ttft_s_median": round(statistics.median(r["decode_ttft_s"] for r in rs), 4),
            "prefill_s_median": round(statistics.median(r["prefill_s"] for r in rs), 4),
            "decode_s_median": round(statistics.median(r["decode_s"] for r in rs), 4),
            "decode_transfer_metrics": transfer[name],
            "handoff": handoff_figures(rs, stamps),
            "per_request": [_public(r) for r in rs],
        }
    if "hybrid-pd" in rows and "nixl" in rows:
        ours, theirs = out["connectors"]["hybrid-pd"], out["connectors"]["nixl"]
        out["decode_ttft_ratio_nixl_over_hybrid_pd"] = round(
            theirs["decode_ttft_s_median"] / max(ours["decode_ttft_s_median"], 1e-9), 3
        )
    return out


def _cmd_bench_vllm(args: argparse.Namespace) -> int:
    out = bench_vllm(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for name, c in out["connectors"].items():
        print(
            f"{name:10s} exact {c['exact']}/{c['requests']}  agreeing tokens "
            f"{c['mean_agreeing_tokens']}/{out['max_tokens']}  decode TTFT "
            f"{c['decode_ttft_s_median'] * 1e3:.1f} ms  "
            f"prefill {c['prefill_s_median'] * 1e3:.1f} ms",
            file=sys.stdout,
        )
    return 0
