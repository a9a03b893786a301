"""Per worker slot of `serve --engine vllm`, the arguments of its VllmWorkerActor: the vLLM
Python and dtype, the secret, the host, its tensor-parallel size, the CPUs its ranks bind
and its control ports."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hybrid_pd.launcher.serve_config import ServeConfig

logger = logging.getLogger(__name__)


def rank_binds(cpus: Sequence[int], sizes: Sequence[int], where: str = "this host") -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND of servers sharing `cpus`, one per entry of `sizes` (each
    server's tensor-parallel size): ranks separated by "|", each rank's CPUs by ",".

    Every rank of every server gets CPUs of its own where there are enough: the CPUs are
    split evenly over all ranks, in order ("0|1" and "2" for sizes 2 and 1 on four CPUs,
    one left over). With fewer CPUs than ranks, each rank binds one CPU, taken in turn
    ("0|1" and "0" on two CPUs): a server's own ranks never share a CPU (they meet in every
    layer's all-reduce, and one waiting on the other's core stalls both), and the servers'
    ranks pile up on the CPUs as evenly as they can. A server with more ranks than `cpus`
    is refused (ValueError, naming `where`): vLLM's CPU build gives each rank a core."""
    cpus = list(cpus)
    if not cpus:
        raise ValueError(f"{where} gives no CPUs to bind")
    widest = max(sizes, default=1)
    if widest > len(cpus):
        raise ValueError(
            f"tensor-parallel size {widest} needs {widest} CPUs on one node (vLLM's CPU "
            f"build binds each rank to a core of its own); {where} gives {len(cpus)}"
        )
    total = sum(sizes)
    share = len(cpus) // total  # 0: fewer CPUs than ranks, one each in turn
    out, rank = [], 0
    for size in sizes:
        ranks = []
        for _ in range(size):
            if share:
                mine = cpus[rank * share : (rank + 1) * share]
            else:
                mine = [cpus[rank % len(cpus)]]
            ranks.append(",".join(map(str, mine)))
            rank += 1
        out.append("|".join(ranks))
    return out


def vllm_slots(config: ServeConfig, model_path: str) -> dict[tuple[str, int], dict]:
    """Per worker slot, the VllmWorkerActor arguments besides role and model: the vLLM
    Python and dtype, the secret, the host to serve on, the tensor-parallel size, CPUs for
    its ranks (vLLM CPU servers bind their compute threads: servers sharing cores slow each
    other down by orders of magnitude), and fixed control ports (a restarted prefill actor
    comes back where its decode peers look; a prefill server of N ranks serves rank r on
    `control_port + r`, so N consecutive ports are free when chosen). With a fixed host
    (embedded Ray, or --worker-host) decode slots get their peers (each prefill server's
    rank 0) here; with "auto" they learn them once the prefill actors are up.

    Embedded Ray: this machine's CPUs are split among all servers' ranks (`rank_binds`);
    a TP size above its CPU count is refused (ValueError). A cluster: each server binds the
    CPUs of the node it lands on, split among its ranks (one vLLM server per node, see
    docs/vllm.md)."""
    import json
    import os
    from pathlib import Path

    from hybrid_pd.workers.vllm_server import free_port

    dtype = config.dtype
    if dtype is None:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        text = cfg.get("text_config") or {}
        dtype = str(text.get("dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    embedded = config.address is None
    common = {
        "vllm_python": config.resolved_vllm_python(),
        "dtype": dtype.removeprefix("torch."),
        "secret": config.secret,
        "host": config.worker_host or ("127.0.0.1" if embedded else "auto"),
        "ucx_tls": config.ucx_tls,
    }
    order = [("prefill", i) for i in range(config.prefill)]
    order += [("decode", i) for i in range(config.decode)]
    sizes = [config.tp_size(role) for role, _ in order]
    if embedded:
        binds = rank_binds(sorted(os.sched_getaffinity(0)), sizes)
        if len(os.sched_getaffinity(0)) < sum(sizes):
            logger.warning(
                "%d vLLM ranks on %d CPUs: ranks of different servers share CPUs (%s)",
                sum(sizes),
                len(os.sched_getaffinity(0)),
                "; ".join(f"{r}-{i}: {b}" for (r, i), b in zip(order, binds, strict=True)),
            )
    else:
        binds = ["node"] * len(order)
    slots: dict[tuple[str, int], dict] = {}
    taken: set[int] = set()
    for (role, i), size, bind in zip(order, sizes, binds, strict=True):
        slot = {**common, "cpus": bind, "tensor_parallel_size": size}
        if role == "prefill":
            for _ in range(64):  # ranges of other prefill slots are not bound yet
                port = free_port(span=size)
                if taken.isdisjoint(range(port, port + size)):
                    break
            else:
                raise OSError(f"no {size} free control ports apart from {sorted(taken)}")
            taken.update(range(port, port + size))
            slot["control_port"] = port
        slots[(role, i)] = slot
    if common["host"] != "auto":  # where each prefill actor's connector (rank 0) listens
        peers = tuple(
            f"{common['host']}:{slot['control_port']}"
            for (role, _), slot in slots.items()
            if role == "prefill"
        )
        for (role, _), slot in slots.items():
            if role == "decode":
                slot["peers"] = peers
    return slots
