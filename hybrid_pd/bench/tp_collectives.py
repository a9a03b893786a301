"""Latency of one tensor-parallel collective: gloo's (loopback TCP) next to the group's
shared-memory ones, in one group of real rank processes, the two alternating block by block.

`python -m hybrid_pd.bench.tp_collectives [--size 2] [--iters 500] [--reps 3]` prints one JSON
line: per collective and shape, the median over blocks of the mean microseconds per call,
for each path, and their ratio. Every rank runs one torch thread (as TP's ranks on a
two-core host do)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

#: (name, shape, dtype name): a decode step's activations at batch 1 and 8, a prefill's
#: of 8 x 128 tokens (hidden 512, as `bench tp`'s throughput model).
TENSORS = (
    ("all_reduce[1,512] f32", (1, 512), "float32"),
    ("all_reduce[8,512] bf16", (8, 512), "bfloat16"),
    ("all_reduce[1024,512] f32", (1024, 512), "float32"),
)


def _step_plan_like(batch: int) -> Any:
    """An object the size of a decode step's plan (rank 0's broadcast each step)."""
    seqs = [
        (str(i), [1000 + i], 128 + i, [[i * 8 + j for j in range(9)]], None) for i in range(batch)
    ]
    return ([], seqs)


def _rank(args: argparse.Namespace) -> dict[str, Any] | None:
    import torch

    from hybrid_pd.engine.tp.group import join_group, leave_group

    torch.set_num_threads(1)
    group = join_group(args.rank, args.size, args.rendezvous)
    if group.shm is None:
        raise RuntimeError("the group has no shared-memory collectives")
    paths = {"gloo": dataclasses.replace(group, shm=None), "shm": group}
    cases = []
    for name, shape, dt in TENSORS:
        x = torch.randn(shape).to(getattr(torch, dt))
        cases.append((name, lambda g, x=x: g.all_reduce(x)))
    for batch in (1, 8):
        obj = _step_plan_like(batch)
        cases.append((f"broadcast(step plan, batch {batch})", lambda g, o=obj: g.broadcast(o)))
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in paths} for n, _ in cases}
    for name, call in cases:
        for path in paths.values():  # warm both
            for _ in range(20):
                call(path)
        for _ in range(args.reps):
            for label, path in paths.items():
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    call(path)
                times[name][label].append((time.perf_counter() - t0) / args.iters * 1e6)
    leave_group(group)
    if args.rank != 0:
        return None
    rows = []
    for name, by_path in times.items():
        gloo, shm = statistics.median(by_path["gloo"]), statistics.median(by_path["shm"])
        rows.append(
            {
                "collective": name,
                "gloo_us": round(gloo, 1),
                "shm_us": round(shm, 1),
                "gloo_us_per_rep": [round(t, 1) for t in by_path["gloo"]],
                "shm_us_per_rep": [round(t, 1) for t in by_path["shm"]],
                "speedup": round(gloo / shm, 1),
            }
        )
    return {"size": args.size, "iters": args.iters, "reps": args.reps, "rows": rows}


def run(size: int, iters: int, reps: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """A group of `size` fresh rank processes; rank 0's JSON."""
    from hybrid_pd.engine.tp.group import open_rendezvous

    store, address = open_rendezvous(size)
    common = ["--size", str(size), "--rendezvous", address, "--iters", str(iters)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--rank", str(r), *common, "--reps", str(reps)],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        for r in range(size)
    ]
    outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    del store
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_pd.bench.tp_collectives")
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is None:
        print(json.dumps(run(args.size, args.iters, args.reps)))
        return 0
    result = _rank(args)
    if result is not None:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
