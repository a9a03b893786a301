"""The ranks of a tensor-parallel engine on this host: rank 0 runs in the calling process,
the others as child processes of `python -m hybrid_pd.launcher.tp_rank`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def start_followers(
    model: str, size: int, rendezvous: str, engine_config, device: str | None, threads: int | None
) -> list[subprocess.Popen]:
    """Ranks 1 .. size-1 of a group whose rank 0 opened `rendezvous` ("host:port")."""
    procs = []
    for rank in range(1, size):
        cmd = [
            sys.executable,
            "-m",
            "hybrid_pd.launcher.tp_rank",
            "--model",
            model,
            "--rank",
            str(rank),
            "--size",
            str(size),
            "--rendezvous",
            rendezvous,
            "--engine-config",
            json.dumps(dataclasses.asdict(engine_config)),
        ]
        if device:
            cmd += ["--device", device]
        if threads:
            cmd += ["--threads", str(threads)]
        procs.append(subprocess.Popen(cmd))
    return procs


def stop_followers(procs: Sequence[subprocess.Popen], timeout_s: float = 30.0) -> list[int]:
    """Wait for released followers to exit (killing any that do not); their exit codes."""
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_pd.launcher.tp_rank")
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--rendezvous", required=True)
    p.add_argument("--engine-config", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from hybrid_pd.engine.engine import EngineConfig
    from hybrid_pd.engine.loader import load_model
    from hybrid_pd.engine.malloc import tune_malloc
    from hybrid_pd.engine.threads import set_torch_threads
    from hybrid_pd.engine.tiny import resolve_model
    from hybrid_pd.engine.tp.follower import Follower
    from hybrid_pd.engine.tp.group import join_group, leave_group

    set_torch_threads(args.threads, workers_on_this_host=args.size)
    tune_malloc()
    group = join_group(args.rank, args.size, args.rendezvous, args.device)
    try:
        model, config, _ = load_model(resolve_model(args.model), device=args.device, tp=group)
        config_fields = json.loads(args.engine_config)
        Follower(model, config, EngineConfig(**config_fields), group).run()
    finally:
        leave_group(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
