"""The vLLM side of `hybrid-pd bench engine --peer vllm`, and the timing both sides share.

Run as `python -m hybrid_pd.bench.peer_vllm --model PATH ...` under the Python that
has vLLM. It loads `vllm.LLM` once, says `{"ok": true, ...}` on its protocol stream, then
answers one JSON line per request line read from stdin:

    {"op": "run", "prompts": [[ids...], ...], "max_tokens": N}
        -> {"ok": true, "prefill_s": s, "decode_s": s, "token_ids": [[ids...], ...]}
    {"op": "quit"}  -> exits

Errors come back as `{"ok": false, "error": "..."}`. vLLM logs to stdout, so the protocol
uses a private copy of the original stdout and everything else printed goes to stderr.

Timing, the same on both sides (`timed_steps`): the batch is submitted at t0 and the engine is
stepped until every request has finished. Prefill time = t0 to the step after which every
request has its first token; decode time = from then to the last request's end. Prefill
tokens/s = batch * prompt_len / prefill time; decode tokens/s = batch * (max_tokens - 1) /
decode time (`rates`). This module imports nothing heavy at import time: the parent imports it
for `timed_steps` and `rates`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

#: (request id, output token ids so far, finished) for each request a step advanced.
StepOutput = tuple[str, Sequence[int], bool]


@dataclass(frozen=True)
class Timing:
    prefill_s: float
    decode_s: float
    token_ids: list[list[int]]  # in the order of the request ids "0", "1", ...


def timed_steps(
    submit: Callable[[], None], step: Callable[[], Iterable[StepOutput]], num_requests: int
) -> Timing:
    """Submit the batch (requests "0".."n-1"), then step until all have finished."""
    got: dict[str, list[int]] = {}
    finished: set[str] = set()
    t0 = time.perf_counter()
    submit()
    first = None
    while len(finished) < num_requests:
        for rid, ids, done in step():
            got[rid] = list(ids)
            if done:
                finished.add(rid)
        if first is None and len(got) == num_requests and all(got.values()):
            first = time.perf_counter()
    end = time.perf_counter()
    if first is None:  # every request ended without a token: nothing to time
        raise RuntimeError("no request produced a token")
    return Timing(first - t0, end - first, [got[str(i)] for i in range(num_requests)])


def rates(batch_size: int, prompt_len: int, max_tokens: int, timing: Timing) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) as the module docstring defines them."""
    prefill = batch_size * prompt_len / max(timing.prefill_s, 1e-9)
    decode = batch_size * (max_tokens - 1) / max(timing.decode_s, 1e-9)
    return prefill, decode


def agreeing_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two outputs share (where they part, if they do)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _VllmSide:
    def __init__(self, args: argparse.Namespace) -> None:
        import vllm

        self.llm = vllm.LLM(
            model=args.model,
            dtype=args.dtype,
            # eager unless asked for vLLM's default (torch.compile'd graphs, compiled at load)
            enforce_eager=not args.compiled,
            enable_prefix_caching=False,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_batch,
            max_num_batched_tokens=max(args.max_batched_tokens, args.max_model_len),
            kv_cache_memory_bytes=args.kv_cache_bytes,
            disable_log_stats=True,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        self.sampling = vllm.SamplingParams
        import torch

        self.info = {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "dtype": str(self.llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            # the CPUs this front-end process (and the engine-core process it starts) may use
            "process_cpus": sorted(os.sched_getaffinity(0)),
            # which of vLLM's kernel builds the processor's report selects (peer_site)
            "kernels_avx512": bool(torch.cpu._is_avx512_supported()),
            "mode": "compiled" if args.compiled else "eager",
        }

    def run(self, prompts: list[list[int]], max_tokens: int) -> Timing:
        params = self.sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

        def submit() -> None:
            for i, p in enumerate(prompts):
                self.engine.add_request(str(i), {"prompt_token_ids": p}, params)

        def step() -> Iterable[StepOutput]:
            return [(o.request_id, o.outputs[0].token_ids, o.finished) for o in self.engine.step()]

        return timed_steps(submit, step, len(prompts))


def _serve(side: _VllmSide, inp: TextIO, out: TextIO) -> None:
    for line in inp:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg.get("op") == "quit":
            return
        try:
            t = side.run(msg["prompts"], msg["max_tokens"])
            reply: dict[str, Any] = {
                "ok": True,
                "prefill_s": t.prefill_s,
                "decode_s": t.decode_s,
                "token_ids": t.token_ids,
            }
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-batch", type=int, required=True)
    p.add_argument("--max-batched-tokens", type=int, required=True)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--compiled", action="store_true", help="vLLM's default mode, not eager")
    args = p.parse_args(argv)
    # The protocol owns the original stdout; whatever vLLM prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        side = _VllmSide(args)
    except Exception:
        out.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ok": True, **side.info}) + "\n")
    out.flush()
    _serve(side, sys.stdin, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
