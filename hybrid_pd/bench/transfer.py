"""`hybrid-pd bench transfer`: KV hand-over bandwidth on a real-size layout.

A child process plays the prefill worker (pool, leases, KVControl gRPC server, UCX); this
process plays the decode worker (pool, DecodeConnector). For each request length the child
keeps a synthetic request's blocks exactly as the engine would (prefill allocation, then
out-of-window release) and this side pulls them through the real control and data planes.
Next to each figure: raw ucxx bandwidth of one buffer of the same total size between the
same two processes, measured right after each pull (alternating), and the median of the
pairs' ratios. No model weights are needed: only the layout is real.
Each kept page starts with its block id on the prefill side; `intact` says every pulled page
arrived with the id of the block it was paired with.

With `churn` > 0 both sides first run that many mixed requests through their own
KVCacheManager (`kvcache.churn`: random lengths, random free order, prefix caching on as
in the engine), in a pool twice the size a lone request needs, so the measured requests get
the block ids a busy pool hands out. Without churn the pool is fresh and caching is off.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
from typing import Any

import torch

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.bench.raw_ucx import raw_bandwidth
from hybrid_pd.connector.control import AioServer, KVControlServicer
from hybrid_pd.connector.decode import DecodeConnector
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.prefill import PrefillConnector
from hybrid_pd.connector.segments import PoolRegions
from hybrid_pd.connector.ucx import UcxTransport
from hybrid_pd.kvcache.churn import churn as run_churn
from hybrid_pd.kvcache.config import KVCacheConfig
from hybrid_pd.kvcache.grouping import HMAOffError, plan_groups
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID, RequestId
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.reference_configs import reference_config
from hybrid_pd.proto import kv_control_pb2_grpc

_TIMEOUT = 120.0
_CHUNK = 2048  # prefill chunk of the synthetic requests


class _Req:
    def __init__(self, rid: str, n: int) -> None:
        self.request_id, self.prompt_ids, self.output_ids = rid, list(range(n)), [1]


def _config(model: str, max_len: int) -> tuple[KVCacheConfig, Any]:
    cfg = reference_config(model)
    if cfg is None:
        raise ValueError(f"unknown reference model {model!r}; see `hybrid-pd plan --list`")
    spec = cache_spec_from_config(cfg)
    return plan_groups(spec, ref_len=max_len), spec


def _blocks_for(config: KVCacheConfig, max_len: int) -> int:
    # Steady state of the longest request plus one prefill chunk in every attention group
    # and a state snapshot (at the chunk's end) in every state group.
    chunk_blocks = -(-_CHUNK // config.block_size) + 2
    extra = sum(2 * g.blocks_per_state if g.is_state else chunk_blocks for g in config.groups)
    return config.blocks_per_request(max_len) + extra + 8


def _pool(config: KVCacheConfig, max_len: int, churn: int, seed: int, role: str):
    """The side's manager and block count, churned first when `churn` > 0."""
    need = _blocks_for(config, max_len)
    n_blocks = 2 * need if churn else need
    kv = KVCacheManager(config, n_blocks, enable_caching=churn > 0)
    if churn:
        run_churn(kv, churn, max_len, role=role, chunk=_CHUNK, keep_free=need, seed=seed)
    return kv, n_blocks


def _prefill_child(
    conn, model: str, max_len: int, ucx: dict, churn: int, seed: int, one_sided: bool
) -> None:
    torch.set_num_threads(1)
    config, _ = _config(model, max_len)
    kv, n_blocks = _pool(config, max_len, churn, seed, "prefill")
    held_after_churn = n_blocks - 1 - kv.pool.num_free_blocks
    pool = torch.empty((n_blocks, config.page_size_bytes), dtype=torch.uint8)
    pool.view(-1)[::4096].fill_(7)  # touch the pages
    transport = UcxTransport(ucx_options=ucx)
    transport.start()
    server = AioServer("127.0.0.1:0")
    port = server.port
    layout = KVLayout.of(config, model)
    conn_ = PrefillConnector(
        engine_id="bench-prefill",
        layout=layout,
        control_address=f"127.0.0.1:{port}",
        free_blocks=lambda rid: kv.free(RequestId(rid)),
        region=PoolRegions(lambda: pool),
        transport=transport,
        one_sided=one_sided,
    )
    servicer = KVControlServicer("bench-prefill", layout, transport.address, conn_)
    server.add(lambda s: kv_control_pb2_grpc.add_KVControlServicer_to_server(servicer, s))
    server.start()
    conn.send(("ready", transport.address))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "lease":
                rid, n = args
                tokens = list(range(n))
                rid_ = RequestId(rid)
                for start in range(0, n, _CHUNK):  # chunked prefill, as the engine does it
                    step = min(_CHUNK, n - start)
                    if kv.allocate_slots(rid_, tokens, step) is None:
                        raise RuntimeError("bench pool too small")
                    kv.commit_computed(rid_, start + step)
                kv.release_out_of_window(rid_)
                ids = kv.block_ids(rid_)
                _stamp(pool, _real(ids))
                _, params = conn_.request_finished_all_groups(_Req(rid, n), ids)
                conn.send(params)
            elif cmd == "raw":
                peer, tag, nbytes, repeats = args
                buf = pool.view(-1)[:nbytes]
                conn.send(
                    raw_bandwidth(
                        transport, peer, tag, buf, repeats=repeats, send=True, timeout=_TIMEOUT
                    )
                )
            elif cmd == "leaks":
                conn.send(n_blocks - 1 - kv.pool.num_free_blocks - held_after_churn)
            else:
                break
    finally:
        server.stop(0.0)
        transport.close()


_STAMP = 8  # each kept page starts with its block id (int64) on the prefill side


def _real(groups) -> list[int]:
    """The block ids of all groups, null blocks left out."""
    return [b for g in groups for b in g if b != NULL_BLOCK_ID]


def _stamp(pool: torch.Tensor, ids: list[int]) -> None:
    idx = torch.tensor(ids, dtype=torch.int64)
    pool[idx, :_STAMP] = idx.view(torch.uint8).view(len(ids), _STAMP)


def _intact(pool: torch.Tensor, src: tuple, dst: tuple) -> bool:
    """Whether every destination page carries the stamp of its source block."""
    pairs = [
        (s, d)
        for gs, gd in zip(src, dst, strict=True)
        for s, d in zip(gs, _real([gd]), strict=True)
    ]
    want = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
    got = pool[[d for _, d in pairs], :_STAMP].contiguous().view(torch.int64).view(-1)
    return bool(torch.equal(got, want))


def bench_transfer(
    model: str = "qwen3.5-27b",
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768),
    repeats: int = 3,
    ucx_tls: str | None = None,
    churn: int = 0,
    seed: int = 0,
    scatter_gather: bool = True,
    one_sided: bool = True,
) -> dict[str, Any]:
    """Bandwidth rows per length (see the module docstring). `messages_per_request` is the
    mean over the repeats (reads, for one-sided pulls); `leaked_blocks` counts blocks the
    measured requests left held. `scatter_gather`: the decode side packs regions into
    scatter-gather messages (two-sided). `one_sided`: decode reads the blocks itself
    (`connector.onesided`), else the prefill side sends them."""
    max_len = max(lengths)
    config, spec = _config(model, max_len)
    ucx = {"NET_DEVICES": "lo"}
    if ucx_tls:
        ucx["TLS"] = ucx_tls
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_prefill_child,
        args=(child, model, max_len, ucx, churn, seed, one_sided),
        daemon=True,
    )
    proc.start()
    transport = UcxTransport(ucx_options=ucx)
    transport.start()
    try:
        if not parent.poll(_TIMEOUT):
            raise RuntimeError("prefill side did not start")
        _, peer = parent.recv()
        kv, n_blocks = _pool(config, max_len, churn, seed + 1, "decode")
        held_after_churn = n_blocks - 1 - kv.pool.num_free_blocks
        pool = torch.zeros((n_blocks, config.page_size_bytes), dtype=torch.uint8)
        decode = DecodeConnector(
            engine_id="bench-decode",
            layout=KVLayout.of(config, model),
            transport=transport,
            region=PoolRegions(lambda: pool),
            timeout_s=_TIMEOUT,
            scatter_gather=scatter_gather,
            one_sided=one_sided,
        )
        try:
            off = plan_groups(spec, hma=False, block_size=config.block_size)
        except HMAOffError:
            off = None
        rows = []
        intact = True
        tag = 1 << 50
        for n in (min(lengths), *lengths):  # the first run warms up endpoints and pages
            times, raw, messages = [], [], []
            for r in range(repeats):  # alternating: a pull, then raw ucxx of the same bytes
                parent.send(("lease", f"r{n}-{r}", n))
                params = KVTransferParams.from_dict(_recv(parent, proc))
                decode.add_peers([params.control_address])
                rid = RequestId(params.request_id)
                ids = kv.allocate_external(rid, list(range(n + 1)), n)
                pool[_real(ids), :_STAMP] = 0
                stats = decode.pull(params, ids)
                intact = intact and _intact(pool, params.block_ids, ids)
                times.append(stats.seconds)
                messages.append(stats.messages)
                nbytes = stats.bytes
                if kv.enable_caching:  # the bytes arrived: the engine commits them
                    kv.commit_computed(rid, n)
                kv.free(rid)
                parent.send(("raw", transport.address, tag, nbytes, 1))
                buf = pool.view(-1)[:nbytes]
                raw += raw_bandwidth(
                    transport, peer, tag, buf, repeats=1, send=False, timeout=_TIMEOUT
                )
                _recv(parent, proc)
                tag += 1
            kv_s, raw_s = statistics.median(times), statistics.median(raw)
            # each pull against the raw transfer right after it
            pair_ratios = [b / a for a, b in zip(times, raw, strict=True)]
            rows.append(
                {
                    "tokens": n,
                    "bytes": nbytes,
                    "bytes_min": config.bytes_per_request(n),
                    "bytes_hma_off": off.bytes_per_request(n) if off else None,
                    "messages": messages[-1],
                    "messages_per_request": round(statistics.mean(messages), 1),
                    "kv_seconds": round(kv_s, 5),
                    "kv_gb_per_s": round(nbytes / kv_s / 1e9, 3),
                    "raw_gb_per_s": round(nbytes / raw_s / 1e9, 3),
                    "ratio": round(statistics.median(pair_ratios), 3),
                }
            )
        parent.send(("leaks",))
        prefill_leaks = _recv(parent, proc)
        pull_kind = decode.pull_kind(params.control_address)
        decode.close()
        return {
            "model": model,
            "block_size": config.block_size,
            "page_size_bytes": config.page_size_bytes,
            "num_groups": len(config.groups),
            "ucx": ucx,
            "churn": churn,
            "scatter_gather": scatter_gather,
            # whether the pulls were read one-sided (the transport's counters say)
            "one_sided": transport.stats()["messages_read"] > 0,
            # how: "read" (process_vm_readv, same host), "ucx-read", "sent" (two-sided)
            "pull_kind": pull_kind,
            "prefix_caching": churn > 0,
            "hma_off_error": None if off else "state layers: the model cannot run with HMA off",
            "runs": rows[1:],
            "intact": intact,  # every pulled page held its source block's stamp
            "leaked_blocks": {
                "prefill": prefill_leaks,
                "decode": n_blocks - 1 - kv.pool.num_free_blocks - held_after_churn,
            },
        }
    finally:
        parent.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        transport.close()


def _recv(conn, proc):
    """The child's next answer; fails instead of hanging when the child died."""
    if not conn.poll(_TIMEOUT):
        raise RuntimeError(f"prefill side gave no answer (exit code {proc.exitcode})")
    return conn.recv()
