"""One rank of `test_tp_shm.py`'s groups: `python -m tests.engine.shm_peer --rank R --size N
--rendezvous HOST:PORT --mode MODE`, prints one JSON line.

Modes:
- `exact`: rounds of all-reduces (float32, bfloat16, float16; tensors smaller and larger than a
  slot; infinities, overflows, ties and subnormals), column gathers to rank 0 (uneven runs,
  more rows than a slot holds; through shared memory and through gloo) and broadcasts
  (small, None, larger than a slot) mixed; each sum compared bit for bit with the
  rank-ordered sum of every rank's input (which each rank can make: inputs are seeded by
  rank) and with gloo's path; each gather with every rank's parts side by side; each
  broadcast with what rank 0 sent.
- `die-after-one`: one all-reduce, then rank `--victim` exits (code 3) while the others wait in
  an all-reduce (or, where the victim is rank 0, in a broadcast): they report what they got
  and how long it took.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from hybrid_pd.engine.tp.group import join_group, leave_group
from hybrid_pd.engine.tp.shm_collectives import PeerLost

SHAPES = [(1, 512), (8, 128, 512), (3, 7), (70_000,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _input(rank: int, round_: int, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * round_ + rank)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    if shape == (3, 7):  # values whose sums overflow, round to a tie or sit below normal
        special = [float("inf"), -3e38, 1 + 2**-8, 1e-39, -0.0, 2**-8, 65504.0]
        x[0] = torch.tensor(special) * (rank + 1)
    return x


def _reference(size: int, round_: int, shape, dtype) -> torch.Tensor:
    wide = [_input(r, round_, shape, dtype).float() for r in range(size)]
    total = wide[0].clone()
    for part in wide[1:]:
        total += part
    return total.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8))
    )


def _objects(round_: int) -> list:
    big = bytes(range(256)) * (1200 + round_)  # ~300 KiB: over the tests' 64 KiB slot
    return [{"round": round_, "ids": list(range(round_ * 10))}, None, ("big", big)]


def _columns(size: int, total: int) -> list[tuple[int, int]]:
    return [(r * total // size, (r + 1) * total // size) for r in range(size)]


#: (rows, columns, dtype) gathered: one call; uneven runs; more rows than a slot holds
GATHERS = [(1, 1001, torch.float32), (3, 30_001, torch.bfloat16), (40, 9_000, torch.float32)]


def _gathers_exact(group, gloo, round_: int) -> list[str]:
    bad = []
    for rows, total, dtype in GATHERS:
        columns = _columns(group.size, total)
        parts = [
            _input(r, round_, (rows, hi - lo), torch.float32).to(dtype)
            for r, (lo, hi) in enumerate(columns)
        ]
        want = torch.cat(parts, dim=1)
        for name, g in (("shm", group), ("gloo", gloo)):
            got = g.gather_columns(parts[group.rank], columns)
            ok = _same_bits(got, want) if group.is_leader else got is None
            if not ok:
                bad.append(f"gather_columns {name} {round_} {rows}x{total} {dtype}")
    return bad


def run_exact(group, rounds: int) -> dict:
    gloo = dataclasses.replace(group, shm=None)
    bad: list[str] = []
    calls = 0
    for round_ in range(rounds):
        for shape in SHAPES:
            for dtype in DTYPES:
                x = _input(group.rank, round_, shape, dtype)
                want = _reference(group.size, round_, shape, dtype)
                got = group.all_reduce(x)
                if not _same_bits(got, want):
                    bad.append(f"all_reduce {round_} {shape} {dtype}")
                if round_ == 0 and not _same_bits(gloo.all_reduce(x), got):
                    bad.append(f"gloo differs {shape} {dtype}")
                calls += 1
        bad += _gathers_exact(group, gloo, round_)
        calls += len(GATHERS)
        for obj in _objects(round_):
            got = group.broadcast(obj if group.is_leader else "not rank 0's")
            if got != obj:
                bad.append(f"broadcast {round_} {type(obj).__name__}")
            calls += 1
    return {"bad": bad, "calls": calls, "shm": group.shm is not None}


def run_die(group, victim: int) -> dict:
    group.all_reduce(torch.ones(4))
    if group.rank == victim:
        sys.stdout.flush()
        os._exit(3)
    t0 = time.monotonic()
    try:
        if victim == 0:
            group.broadcast()
        else:
            group.all_reduce(torch.ones(4))
        error = None
    except PeerLost as e:
        error = str(e)
    return {"error": error, "waited_s": time.monotonic() - t0, "shm": group.shm is not None}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--rendezvous", required=True)
    p.add_argument("--mode", required=True, choices=("exact", "die-after-one"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--victim", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    group = join_group(args.rank, args.size, args.rendezvous, timeout_s=60.0)
    if args.mode == "exact":
        result = run_exact(group, args.rounds)
    else:
        result = run_die(group, args.victim)
    print(json.dumps({"rank": args.rank, **result}), flush=True)
    if args.mode == "exact":
        leave_group(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
