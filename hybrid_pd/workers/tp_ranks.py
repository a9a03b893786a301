"""The ranks of a tensor-parallel engine on this host: rank 0 runs in the calling process,
the others as child processes of `python -m hybrid_pd.workers.tp_ranks` (followers: they
load their shard and take the steps rank 0 announces)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)


def start_followers(
    model: str,
    size: int,
    rendezvous: str,
    engine_config,
    device: str | None,
    threads: int | None,
    share_tag: str | None = None,
) -> list[subprocess.Popen]:
    """Ranks 1 .. size-1 of a group whose rank 0 opened `rendezvous` ("host:port");
    `share_tag`: their pools in shared memory under that tag (engine.tp.shared_pool)."""
    procs = []
    for rank in range(1, size):
        cmd = [
            sys.executable,
            "-m",
            "hybrid_pd.workers.tp_ranks",
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
        if share_tag:
            cmd += ["--share-tag", share_tag]
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


class RankGroup:
    """Rank 0's side of a worker's tensor-parallel group: starts ranks 1 .. size-1 as
    child processes and joins them. With `share_pools`, their pools live in shared memory
    for rank 0 to map (`pools`), as a worker that hands KV over needs."""

    def __init__(
        self,
        model: str,
        size: int,
        engine_config,
        device: str | None = None,
        threads: int | None = None,
        share_pools: bool = False,
        on_lost: Callable[[int, int], None] | None = None,
    ) -> None:
        """`on_lost(rank, exit code)`: called (from a watcher thread) when a rank ends
        before `close`; a worker whose rank is gone cannot step, so it typically exits and
        is re-created whole. Default: log it."""
        from hybrid_pd.engine.tp.group import join_group, open_rendezvous

        if threads is None:
            import torch

            threads = torch.get_num_threads()  # what this rank was given, for each rank

        self.size = size
        self.tag = uuid.uuid4().hex[:12] if share_pools else None
        store, address = open_rendezvous(size)
        self.procs = start_followers(model, size, address, engine_config, device, threads, self.tag)
        try:
            self.group = join_group(0, size, store, device)
        except BaseException:
            stop_followers(self.procs, timeout_s=5.0)
            raise
        self._closed = False
        self._on_lost = on_lost or (
            lambda rank, code: logger.error("tensor-parallel rank %d exited (%s)", rank, code)
        )
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True
            ).start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()  # blocks this watcher only; nothing polls
        if not self._closed:
            self._on_lost(rank, code)

    def pools(self, own) -> list:
        """Every rank's pool in rank order: `own` (rank 0's buffer), then the others'
        shared ones, mapped here (call once, after the engine exists)."""
        from hybrid_pd.engine.tp.shared_pool import map_rank_pools

        if self.tag is None:
            raise ValueError("this group's pools are not shared")
        num_blocks, page = own.shape
        return [own, *map_rank_pools(self.tag, self.size, num_blocks, page)]

    def close(self, engine=None) -> list[int]:
        """Release the followers (through `engine`, rank 0's, when it exists), wait for
        them and leave the group; their exit codes. Idempotent."""
        from hybrid_pd.engine.tp.group import leave_group
        from hybrid_pd.engine.tp.shared_pool import remove_rank_pools

        if self._closed:
            return []
        self._closed = True
        if engine is not None:
            try:
                engine.release_followers()
            except Exception as e:  # a follower already gone: the group is broken anyway
                logger.warning("releasing the tensor-parallel ranks failed: %s", e)
        codes = stop_followers(self.procs, timeout_s=30.0 if engine is not None else 5.0)
        leave_group(self.group)
        if self.tag is not None:
            remove_rank_pools(self.tag, self.size)
        return codes


def _die_with_parent() -> None:
    """A rank whose rank 0 died has nothing left to do: end with it (Linux; elsewhere the
    group's collective timeout ends it)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_pd.workers.tp_ranks")
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--rendezvous", required=True)
    p.add_argument("--engine-config", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--share-tag", default=None, help="keep the pool in /dev/shm under this tag")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    _die_with_parent()

    from hybrid_pd.engine.engine import EngineConfig
    from hybrid_pd.engine.heap import freeze_startup_heap
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
        follower = Follower(model, config, EngineConfig(**config_fields), group, args.share_tag)
        # As in every engine process: a full collection walks torch's and the model's
        # objects (tens of ms), and a follower's pause stalls every rank at the next
        # all-reduce.
        freeze_startup_heap()
        follower.run()
    finally:
        leave_group(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
