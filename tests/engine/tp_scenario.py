"""Rank 0 of a tensor-parallel engine, run as its own process by tests/engine/test_tp.py:
starts the other ranks (`workers.tp_ranks.RankGroup`, as the product does), runs the test's
prompt rounds and prints their greedy tokens as JSON on stdout's last line."""

from __future__ import annotations

import argparse
import json
import sys

from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.engine.threads import set_torch_threads
from hybrid_pd.workers.tp_ranks import RankGroup


def engine_config(max_batched_tokens: int = 24) -> EngineConfig:
    """Small steps by default, so prompts prefill in several chunks, side by side."""
    return EngineConfig(kv_memory_bytes=32 * 2**20, max_num_batched_tokens=max_batched_tokens)


def run_rounds(engine: Engine, rounds: list[list[list[int]]], new: int) -> list[list[list[int]]]:
    """Each round's prompts together; later rounds hit the prefixes earlier ones cached."""
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    return [[o.token_ids for o in engine.generate(prompts, params)] for prompts in rounds]


def scored_rounds(engine: Engine, rounds: list[list[list[int]]], new: int, top: int) -> list:
    """As `run_rounds`, each output asking for `top` logprobs of every sampled and every
    prompt token: per output [tokens, logprobs, prompt logprobs], each logprob
    [value, [[id, value], ...]] (None where there is none)."""
    params = SamplingParams(max_tokens=new, ignore_eos=True, logprobs=top, prompt_logprobs=top)

    def plain(scored):
        return [None if s is None else [s.logprob, [list(p) for p in s.top]] for s in scored]

    return [
        [
            [o.token_ids, plain(o.logprobs), plain(o.prompt_logprobs)]
            for o in engine.generate(prompts, params)
        ]
        for prompts in rounds
    ]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--rounds", required=True, help="JSON: rounds of prompts (token ids)")
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--max-batched-tokens", type=int, default=24)
    p.add_argument("--logprobs", type=int, default=0, help="top logprobs asked (scored_rounds)")
    args = p.parse_args()
    set_torch_threads(1)
    config = engine_config(args.max_batched_tokens)
    ranks = RankGroup(args.model, args.size, config, threads=1)
    engine = None
    try:
        model, hf_config, tok = load_model(args.model, tp=ranks.group)
        engine = Engine(model, hf_config, config, tok, tp=ranks.group)
        rounds = json.loads(args.rounds)
        if args.logprobs:
            out = scored_rounds(engine, rounds, args.new, args.logprobs)
        else:
            out = run_rounds(engine, rounds, args.new)
        steps = engine.num_steps_with_work
        shard = getattr(model, "vocab_shard", None)
        head_rows = None if shard is None else shard.rows(int(hf_config["vocab_size"]))
    finally:
        codes = ranks.close(engine)
    print(
        json.dumps(
            {"tokens": out, "follower_exit_codes": codes, "steps": steps, "head_rows": head_rows}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
