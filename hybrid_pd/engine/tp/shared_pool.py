"""Pools of a tensor-parallel worker's ranks in shared memory, so that rank 0 (the rank
that talks to peers) reaches every rank's KV for hand-offs, while each rank computes on
its own.

Rank r > 0 creates its pool as a file in /dev/shm named after the worker's group tag;
rank 0 maps every such file once the ranks agreed on the pool's shape, then removes the
names (the mappings live on until both processes let go: nothing is left behind when a
process dies after that). CPU pools only: a CUDA rank's pool would be shared through CUDA
IPC, which has not been built.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")


def pool_file(tag: str, rank: int) -> Path:
    return SHM_DIR / f"hybrid-pd-{tag}-rank{rank}"


def _check(device: torch.device | str | None) -> None:
    kind = torch.device(device).type if device is not None else torch.get_default_device().type
    if kind != "cpu":
        raise NotImplementedError(
            "a tensor-parallel worker shares its ranks' pools through /dev/shm, which holds "
            f"CPU memory; pools on {kind} are not supported yet"
        )
    if not SHM_DIR.is_dir():
        raise NotImplementedError(f"{SHM_DIR} is missing: ranks cannot share their pools")


def create_rank_pool(tag: str, rank: int, num_blocks: int, page: int, device=None) -> torch.Tensor:
    """Rank `rank`'s pool memory, zeroed, in a new shared file (uint8 [num_blocks, page])."""
    _check(device)
    path = pool_file(tag, rank)
    if path.exists():
        raise FileExistsError(f"{path} exists: another worker uses tag {tag!r}")
    flat = torch.from_file(str(path), shared=True, size=num_blocks * page, dtype=torch.uint8)
    return flat.view(num_blocks, page)


def map_rank_pools(tag: str, size: int, num_blocks: int, page: int) -> list[torch.Tensor]:
    """Ranks 1 .. size-1's pools (made by `create_rank_pool`), mapped here; their names are
    removed once mapped."""
    pools = []
    for rank in range(1, size):
        path = pool_file(tag, rank)
        have, want = path.stat().st_size, num_blocks * page
        if have != want:
            raise ValueError(f"{path} holds {have} bytes, expected {want}")
        flat = torch.from_file(str(path), shared=True, size=num_blocks * page, dtype=torch.uint8)
        os.unlink(path)
        pools.append(flat.view(num_blocks, page))
    return pools


def remove_rank_pools(tag: str, size: int) -> None:
    """Remove names `map_rank_pools` did not reach (a worker that failed to start)."""
    for rank in range(1, size):
        pool_file(tag, rank).unlink(missing_ok=True)
