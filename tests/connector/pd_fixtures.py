"""Worker processes on 127.0.0.1 for the P/D tests, and reference outputs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.onesided import ENV as ONESIDED_ENV
from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.engine.tp.plans import plan_for
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config, load_config
from hybrid_pd.kvcache.tp_layout import rank_kv_config
from hybrid_pd.launcher.local import WorkerProcess, start_worker
from hybrid_pd.proxy.worker_client import WorkerClient
from hybrid_pd.workers.vllm_server import free_port

KV_MEMORY = "8MiB"


class Pair:
    """A prefill worker and a decode worker (real processes) plus their clients. The two
    start side by side: the prefill worker gets its port up front, decode its address."""

    def __init__(
        self, path: Path, *, prefill_args=(), decode_args=(), env=None, log=None, one_sided=None
    ):
        """`env`: the prefill worker's extra environment; `one_sided`: True / False: both
        workers pull one-sided / two-sided (HYBRID_PD_UCX_ONESIDED=1 / 0); None: the
        default (one-sided)."""
        common = ["--model", str(path), "--kv-memory", KV_MEMORY, "--threads", "1"]
        both = {} if one_sided is None else {ONESIDED_ENV: "1" if one_sided else "0"}
        env = {**both, **(env or {})}
        port = free_port()
        with ThreadPoolExecutor(2) as ex:  # leaving the block waits for both starts
            starts = [
                ex.submit(
                    start_worker, "prefill", *common, "--port", str(port), *prefill_args,
                    env=env, log=log,
                ),
                ex.submit(
                    start_worker, "decode", *common, "--peer", f"127.0.0.1:{port}",
                    *decode_args, env=both, log=log,
                ),
            ]  # fmt: skip
        failed = [f.exception() for f in starts if f.exception() is not None]
        self.procs: list[WorkerProcess] = [f.result() for f in starts if f.exception() is None]
        if failed:
            self.close()
            raise failed[0]
        self.prefill = WorkerClient(self.procs[0].address, timeout_s=120)
        self.decode = WorkerClient(self.procs[1].address, timeout_s=120)

    def close(self) -> None:
        for p in self.procs:  # both stop at once
            p.proc.terminate()
        for p in self.procs:
            p.stop()


def reference_engine(path: Path) -> Engine:
    model, config, tok = load_model(path)
    return Engine(model, config, EngineConfig(kv_memory_bytes=8 * 2**20), tok)


def reference_tokens(engine: Engine, prompt: list[int], n: int) -> list[int]:
    out = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    return out.token_ids


def tp_layout(path: Path, kv_config, size: int) -> KVLayout:
    """The layout of one rank of a worker of `size` ranks serving `path` (`kv_config`: the
    whole model's): its page is what that rank's pool holds of a block."""
    if size == 1:
        return KVLayout.of(kv_config, "m")
    rank_spec = cache_spec_from_config(plan_for(load_config(path), size).rank_config, "float32")
    return KVLayout.of(rank_kv_config(kv_config, rank_spec), "m", kv_config, size)


def prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def no_leaks(stats: dict) -> bool:
    return (
        stats["free_blocks"] == stats["num_blocks"] - 1
        and stats["kv_requests"] == 0
        and stats.get("leases", 0) == 0
        and stats["integrity"] == "ok"
    )


def staged_run(pair: Pair, rid: str, p: list[int], sampling, token: str):
    """Overlap: the Prefill (carrying the transfer token `token`) and a Generate with
    staged params side by side, as the proxy runs them; (prefill reply, decode reply)."""
    staged = KVTransferParams.for_staging(f"{rid}-p", p, pair.procs[0].address, token)
    with ThreadPoolExecutor(2) as ex:
        first = ex.submit(pair.prefill.prefill, f"{rid}-p", p, sampling, transfer_token=token)
        out = ex.submit(pair.decode.generate, f"{rid}-d", p, sampling, staged)
        return first.result(), out.result()
