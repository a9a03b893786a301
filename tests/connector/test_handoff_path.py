"""The hand-off's pull path in one process, with real parts: a KVControl server (grpc.aio),
two UCX transports on loopback, the prefill and decode connectors over torch pools.

Checked: the bytes arrive equal; the prefill side sends from the control server's loop
(no send thread woken); a handshake up front makes the prefill's UCX endpoint before any
pull; the release that follows frees the blocks once; the timeline names every stage, in
order, under the prefill's request id."""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.bench.vllm_handoff import STAGES, handoff_figures, percentile, stage_deltas
from hybrid_pd.connector import timeline
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.decode import DecodeConnector
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.onesided import ENV as ONESIDED_ENV
from hybrid_pd.connector.prefill import PrefillConnector
from hybrid_pd.connector.segments import PoolRegions
from hybrid_pd.connector.setup import add_kv_control, open_server, start_transport
from hybrid_pd.kvcache.grouping import plan_groups
from tests.connector.test_connector_units import _Req, model

SECRET = "handoff-test-secret"


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@dataclass
class _Handoff:
    """Two connectors over torch pools (`src` kept by prefill, `dst` filled by decode),
    a KVControl server and two UCX transports on loopback."""

    layout: KVLayout
    src: torch.Tensor
    dst: torch.Tensor
    freed: list
    tp: object
    td: object
    prefill: PrefillConnector
    decode: DecodeConnector

    @property
    def n_groups(self) -> int:
        return len(self.layout.groups)

    def pull_r(self, caplog) -> tuple:
        """Keep two blocks a group for request "r", pull them into others: (pull stats,
        the request's timeline stamps); the bytes arrived equal."""
        kept = tuple([1 + 3 * i, 2 + 3 * i] for i in range(self.n_groups))
        _, raw = self.prefill.request_finished_all_groups(_Req("r", [1] * 8, [7]), kept)
        params = KVTransferParams.from_dict(raw)
        dst_ids = tuple([12 + 3 * i, 13 + 3 * i] for i in range(self.n_groups))
        caplog.set_level(logging.DEBUG, logger=timeline.__name__)
        stats = self.decode.pull(params, dst_ids)
        for s_ids, d_ids in zip(kept, dst_ids, strict=True):
            for s, d in zip(s_ids, d_ids, strict=True):
                assert torch.equal(self.dst[d], self.src[s])
        assert self.freed == ["r"] and self.prefill.num_leases == 0  # released once
        return stats, timeline.parse(r.getMessage() for r in caplog.records)["r"]


@contextmanager
def _handoff(seed: int, one_sided: bool):
    layout = KVLayout.of(plan_groups(model(), block_size=4), "m")
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (24, layout.page_size_bytes), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    freed: list[str] = []
    tp, td = start_transport("127.0.0.1"), start_transport("127.0.0.1")
    server, address = open_server("127.0.0.1", 0, SECRET)
    # one-sided reads need pools the transports can map (PoolRegions); the two-sided
    # path takes any region function
    src_region = PoolRegions(lambda: src) if one_sided else (lambda b, n: src[b : b + n])
    dst_region = PoolRegions(lambda: dst) if one_sided else (lambda b, n: dst[b : b + n])
    prefill = PrefillConnector(
        engine_id="p",
        layout=layout,
        control_address=address,
        free_blocks=freed.append,
        region=src_region,
        transport=tp,
        secret=SECRET,
        one_sided=one_sided,  # opt-in in a worker (HYBRID_PD_UCX_ONESIDED=1)
    )
    decode = None
    try:
        add_kv_control(server, "p", layout, tp, prefill)
        server.start()
        decode = DecodeConnector(
            engine_id="d",
            layout=layout,
            transport=td,
            region=dst_region,
            secret=SECRET,
            peers=(address,),
            one_sided=one_sided,
        )
        decode.dial(address)
        yield _Handoff(layout, src, dst, freed, tp, td, prefill, decode)
    finally:
        if decode is not None:
            decode.close()
        server.stop()
        prefill.close()
        tp.close()
        td.close()


def test_pull_sends_from_the_control_loop_and_stamps_each_stage(caplog):
    with _handoff(3, one_sided=False) as h:
        # the handshake made the prefill's UCX endpoint to us, in the background
        assert _wait(lambda: h.tp.endpoint_count == 1, 10.0)
        stats, stamps = h.pull_r(caplog)
        assert stats.bytes == 2 * h.n_groups * h.layout.page_size_bytes
        assert not [t for t in threading.enumerate() if t.name.startswith("kv-send")]
        seen = [s for s in STAGES if s in stamps]
        assert seen == [
            "peer_ready",
            "recvs_posted",
            "pull_received",
            "keep_present",
            "sends_posted",
            "sends_done",
            "pull_replied",
            "bytes_arrived",
        ]
        times = [stamps[s] for s in seen]
        assert times == sorted(times)
        deltas = stage_deltas(stamps)
        assert set(deltas) == set(seen[1:]) and all(v >= 0 for v in deltas.values())


def test_the_decode_arrival_is_measured_from_the_params_not_the_keep_beside_it():
    # the client reached the decode server before the prefill's worker stamped its keep
    stamps = {"params_out": 10.0, "keep_meta": 10.001, "decode_arrived": 10.002, "kept": 10.003}
    deltas = stage_deltas(stamps)
    assert deltas == {"keep_meta": 1.0, "kept": 2.0, "decode_arrived": 2.0}


def test_handoff_figures_per_prompt_length():
    t = 1000.0
    rows = []
    stamps = {}
    for i, (n, ttft) in enumerate([(128, 0.05), (128, 0.07), (2048, 0.2)]):
        rid = f"r{i}"
        stamps[rid] = {"params_out": t, "pull_start": t + 0.01, "bytes_arrived": t + 0.03}
        stamps[rid]["first_step"] = t + 0.04 + i * 0.01
        rows.append({"prompt_len": n, "decode_ttft_s": ttft, "handoff_id": rid})
    rows.append({"prompt_len": 2048, "decode_ttft_s": 0.3, "handoff_id": "nixl-id"})
    out = handoff_figures(rows, stamps)
    assert set(out) == {"128", "2048"}
    assert out["128"]["decode_ttft_s"] == {"p50": 0.05, "p99": 0.07, "max": 0.07, "n": 2}
    assert out["128"]["handoff_s"]["p99"] == 0.05 and out["128"]["pull_s"]["n"] == 2
    assert out["2048"]["handoff_s"]["n"] == 1  # the row without stamps has client figures only
    assert out["2048"]["decode_ttft_s"]["n"] == 2
    assert out["128"]["stages_ms_p50"]["pull_start"] == 10.0
    assert percentile([3, 1, 2], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4


@pytest.mark.parametrize("reader", ["on", "ucx"])
def test_one_sided_pull_reads_exactly_the_kept_blocks_and_sends_nothing(
    caplog, monkeypatch, reader
):
    """Pools the transports can map: decode reads the kept blocks itself (the prefill side
    sends no message), the bytes equal the source's, the bytes read are exactly the
    blocks' (the minimum), the release frees once; a read of a lease that ended is void.
    On one host the reader copies with process_vm_readv ("on", the default) or through
    UCX's get ("ucx", what a reader on another host uses)."""
    monkeypatch.setenv(ONESIDED_ENV, reader)
    with _handoff(5, one_sided=True) as h:
        prefill, tp, td = h.prefill, h.tp, h.td
        (peer,) = h.decode._peers.values()
        assert peer.remote.pid == (os.getpid() if reader == "on" else 0)
        stats, stamps = h.pull_r(caplog)
        minimum = 2 * h.n_groups * h.layout.page_size_bytes
        assert stats.bytes == minimum and td.stats()["bytes_read"] == minimum
        assert tp.stats()["messages_sent"] == 0 and td.stats()["messages_received"] == 0
        assert prefill.stats_snapshot()["read_pulls"] == 1
        assert prefill.stats_snapshot()["bytes_sent"] == minimum
        seen = [s for s in STAGES if s in stamps]
        assert seen == [
            "peer_ready",
            "reads_posted",
            "reads_done",
            "read_confirmed",
            "pull_replied",
            "bytes_arrived",
        ]
        # a lease that ended before the confirmation: the read is void, the pull fails
        kept = tuple([1 + 3 * i, 2 + 3 * i] for i in range(h.n_groups))
        dst_ids = tuple([12 + 3 * i, 13 + 3 * i] for i in range(h.n_groups))
        _, raw = prefill.request_finished_all_groups(_Req("q", [1] * 8, [7]), kept)
        late = KVTransferParams.from_dict(raw)
        prefill.release(late.request_id, late.transfer_token)
        with pytest.raises(TransferFailed, match="no KV kept"):
            h.decode.pull(late, dst_ids)
        assert prefill.stats_snapshot()["read_pulls"] == 1
