"""`bench tp`'s hand-off half: a prefill worker at TP P and a decode worker at TP D (real
processes on 127.0.0.1), a few greedy prompts through them, compared with one TP-1 engine
in this process; the bytes each decode rank received next to the least it needs."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: Each worker's KV memory: room for the longest prompt many times over.
KV_MEMORY = "32MiB"


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """Pairs from "1-1,1-2": [(1, 1), (1, 2)]; ValueError for anything else."""
    pairs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        p, sep, d = item.partition("-")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"a TP pair is PREFILL-DECODE, e.g. 1-2; got {item!r}")
        pairs.append((int(p), int(d)))
    if not pairs:
        raise ValueError("no TP pair given")
    return pairs


def prompt(n: int, seed: int) -> list[int]:
    """`n` random byte-token ids (3 .. 255), the same for a given seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


class Reference:
    """One TP-1 engine in this process on the checkpoint: the tokens every pair must give,
    and the layouts the pairs' hand-offs move between."""

    def __init__(self, path: Path, prompts: list[list[int]], new_tokens: int) -> None:
        from hybrid_pd.engine.engine import Engine, EngineConfig
        from hybrid_pd.engine.loader import load_model
        from hybrid_pd.engine.sampling import SamplingParams

        self.path = path
        model, config, tok = load_model(path)
        engine = Engine(model, config, EngineConfig(kv_memory_bytes=32 * 2**20), tok)
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        self.tokens = [engine.generate([p], params)[0].token_ids for p in prompts]
        self.kv_config = engine.kv_config
        self._layouts: dict[int, Any] = {}

    @property
    def distinct_tokens(self) -> int:
        """How many different token ids the reference produced over all prompts."""
        return len({t for out in self.tokens for t in out})

    def layout(self, size: int):
        """The KV layout a worker of TP `size` hands over or receives (`connector.layout`)."""
        if size not in self._layouts:
            from hybrid_pd.connector.layout import KVLayout
            from hybrid_pd.engine.tp.plans import plan_for
            from hybrid_pd.kvcache.hf_configs import cache_spec_from_config, load_config
            from hybrid_pd.kvcache.tp_layout import rank_kv_config

            if size == 1:
                self._layouts[size] = KVLayout.of(self.kv_config, "m")
            else:
                rank_config = plan_for(load_config(self.path), size).rank_config
                spec = cache_spec_from_config(rank_config, "float32")
                rank_kv = rank_kv_config(self.kv_config, spec)
                self._layouts[size] = KVLayout.of(rank_kv, "m", self.kv_config, size)
        return self._layouts[size]

    def min_bytes_by_rank(self, p_tp: int, d_tp: int, block_ids) -> list[int]:
        """The bytes each decode rank needs for one hand-off of `block_ids` (the prefill
        worker's, per group): its own slot pieces between different sizes, whole pages
        rank to rank between equal ones."""
        from hybrid_pd.connector.tp_plan import ShardedPlan

        plan = ShardedPlan(self.layout(p_tp), self.layout(d_tp), lambda: [])
        return plan.bytes_by_rank(plan.runs(block_ids, block_ids), "dst")


def start_pair(path: Path, p_tp: int, d_tp: int, threads: int = 1) -> list:
    """A prefill worker at TP `p_tp` and a decode worker at TP `d_tp` pulling from it,
    started side by side; [prefill, decode] WorkerProcesses. Stops whichever started when
    the other fails."""
    from hybrid_pd.launcher.local import start_worker
    from hybrid_pd.workers.vllm_server import free_port

    common = ["--model", str(path), "--host", "127.0.0.1", "--kv-memory", KV_MEMORY]
    common += ["--threads", str(threads)]
    port = free_port()
    prefill = [*common, "--port", str(port), "--tensor-parallel-size", str(p_tp)]
    decode = [*common, "--peer", f"127.0.0.1:{port}", "--tensor-parallel-size", str(d_tp)]
    with ThreadPoolExecutor(2) as ex:
        futures = [
            ex.submit(start_worker, "prefill", *prefill, timeout=180),
            ex.submit(start_worker, "decode", *decode, timeout=180),
        ]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        stop_workers(started)
        raise errors[0]
    return started


def stop_workers(workers: list) -> None:
    """Stop every worker at once, then wait for each."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        w.stop()


def run_pair(
    ref: Reference,
    prompts: list[list[int]],
    new_tokens: int,
    p_tp: int,
    d_tp: int,
    threads: int = 1,
    leak_wait_s: float = 5.0,
) -> dict[str, Any]:
    """Every prompt through a fresh P-D pair of workers (prefill there, decode here, greedy).
    `exact`: every output equals the reference's; `bytes_by_rank`: what the decode worker
    counted over these requests; `min_bytes_by_rank`: the least each decode rank needs;
    `leaked_blocks`: blocks still held on each side once idle (waits up to `leak_wait_s`).
    The workers are stopped however the run ends."""
    from hybrid_pd.api.wire import sampling_to_pb
    from hybrid_pd.bench.service import worker_kv_check
    from hybrid_pd.engine.sampling import SamplingParams
    from hybrid_pd.proxy.worker_client import WorkerClient

    t0 = time.perf_counter()
    workers = start_pair(ref.path, p_tp, d_tp, threads)
    started_s = time.perf_counter() - t0
    prefill = WorkerClient(workers[0].address, timeout_s=120)
    decode = WorkerClient(workers[1].address, timeout_s=120)
    try:
        sampling = sampling_to_pb(SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        min_by_rank = [0] * d_tp
        exact, recomputed, errors = True, False, []
        seconds, messages = [], []
        for i, (p, expected) in enumerate(zip(prompts, ref.tokens, strict=True)):
            rid = f"tp-{p_tp}-{d_tp}-{i}"
            first = prefill.prefill(rid, p, sampling)
            kv = first.kv_transfer_params
            out = decode.generate(rid, p, sampling, kv)
            if out.error:
                errors.append(out.error)
            exact = exact and first.first_token == expected[0] and out.token_ids == expected
            recomputed = recomputed or bool(out.transfer.get("recomputed", True))
            seconds.append(out.transfer.get("seconds", 0.0))
            messages.append(out.transfer.get("messages", 0))
            if kv is not None:
                for rank, b in enumerate(ref.min_bytes_by_rank(p_tp, d_tp, kv.block_ids)):
                    min_by_rank[rank] += b
        stats = decode.stats()
        connector = stats["decode_connector"]
        kv_state = worker_kv_check(workers, timeout=leak_wait_s)
    finally:
        prefill.close()
        decode.close()
        stop_workers(workers)
    return {
        "pair": f"{p_tp}-{d_tp}",
        "prefill_tp": p_tp,
        "decode_tp": d_tp,
        "requests": len(prompts),
        "exact": exact and not errors,
        "errors": errors,
        "recomputed": recomputed,
        "bytes_by_rank": connector["bytes_by_rank"],
        "min_bytes_by_rank": min_by_rank,
        "bytes": connector["bytes"],
        "messages": connector["messages"] / len(prompts),
        "messages_by_request": messages,
        "handoff_ms": round(statistics.median(seconds) * 1e3, 3),
        "leaked_blocks": {w["role"]: w["leaked_blocks"] for w in kv_state},
        "clean": all(w["clean"] for w in kv_state),
        "decode_tensor_parallel_size": stats.get("tensor_parallel_size"),
        "start_s": round(started_s, 2),
    }


def run_family(
    family: str,
    path: Path,
    pairs: list[tuple[int, int]],
    lengths: tuple[int, ...],
    new_tokens: int,
    progress=None,
) -> list[dict[str, Any]]:
    """Every pair on one checkpoint; each row names the family and the reference's
    variety (`reference_distinct_tokens`, over all prompts)."""
    prompts = [prompt(n, seed=i) for i, n in enumerate(lengths)]
    ref = Reference(path, prompts, new_tokens)
    rows = []
    for p_tp, d_tp in pairs:
        row = run_pair(ref, prompts, new_tokens, p_tp, d_tp)
        row = {
            "family": family,
            **row,
            "reference_distinct_tokens": ref.distinct_tokens,
            "reference_tokens": sum(len(t) for t in ref.tokens),
        }
        rows.append(row)
        if progress:
            progress(row)
    return rows
