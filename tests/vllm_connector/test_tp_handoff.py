"""Hand-offs between vLLM worker ranks of different tensor-parallel sizes, in one process
with the real parts: each rank's WorkerHalf (its own UCX transport, KVControl server on
control_port + rank, prefill or decode half) over synthetic caches laid out as vLLM's CPU
build lays them out (`tp_caches`), the loads given as vLLM's scheduler gives them
(HybridPDMetadata), one-sided reads.

Checked: every decode rank's caches equal its shard at its own size, byte for byte; each
decode rank pulled from the prefill ranks holding its pieces; a prefill rank reports the
request sent (its blocks freed) only once every decode rank reading from it released it;
without one-sided reads, or with rows that do not map, the load fails saying why; an idle
step waits on every rank, a rank with nothing in flight too.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time

import pytest
import torch

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.connector.prefill import handover_params
from hybrid_pd.connector.vllm import worker
from hybrid_pd.connector.vllm.metadata import HybridPDMetadata, Load, Send
from hybrid_pd.connector.vllm.options import ConnectorOptions
from hybrid_pd.connector.vllm.plan import VllmPlan
from hybrid_pd.connector.vllm.worker import WorkerHalf
from tests.vllm_connector.tp_caches import (
    BLOCK,
    DST_BLOCKS,
    LAYERS,
    NUM_BLOCKS,
    SRC_BLOCKS,
    Attention,
    mamba2,
    rank_caches,
)

KINDS = [Attention(1), mamba2(1)]  # Granite-4.0-H-like: one KV head, n_groups = 1
RID = "req-1"


def _ports(n: int) -> int:
    """A base port with the next n - 1 free too (rank r serves on base + r)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for r in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + r))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def _wait(cond, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class _Ranks:
    """The prefill server's ranks and the decode server's, each a WorkerHalf."""

    def __init__(self, p_size, d_size, d_kinds=None, kinds=None, kv_apart=False) -> None:
        """`kv_apart`: prefill's caches K and V apart, [2, blocks, block, heads, dim]."""
        torch.manual_seed(0)
        self.kinds = kinds or KINDS
        self.fulls = [[k.full() for _ in range(LAYERS)] for k in self.kinds]
        self.d_kinds = d_kinds or self.kinds
        secret = secrets.token_urlsafe(16)
        base = _ports(p_size)
        self.base = f"127.0.0.1:{base}"
        self.prefill, self.decode, self.caches, self.freed = [], [], [], []
        common = dict(secret=secret, cpus=None, engine_id="e")
        for p in range(p_size):
            caches, cfg, layout, _ = rank_caches(self.kinds, self.fulls, p_size, p)
            if kv_apart:
                caches = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, 1, 8) for n in caches}
            opts = ConnectorOptions(control_port=base).for_rank(p)
            w = WorkerHalf(
                layout=layout, options=opts, is_producer=True, is_consumer=False,
                plan=VllmPlan(cfg, caches), rank=p, **{**common, "engine_id": "prefill"},
            )  # fmt: skip
            self.prefill.append(w)
        d_fulls = [[k.full() for _ in range(LAYERS)] for k in self.d_kinds]
        for d in range(d_size):
            caches, cfg, layout, typed = rank_caches(self.d_kinds, d_fulls, d_size, d, fill=-7.0)
            opts = ConnectorOptions(peers=(self.base,)).for_rank(d)
            w = WorkerHalf(
                layout=layout, options=opts, is_producer=False, is_consumer=True,
                plan=VllmPlan(cfg, caches), rank=d, base_peers=(self.base,),
                **{**common, "engine_id": "decode"},
            )  # fmt: skip
            self.decode.append(w)
            self.caches.append(typed)

    def keep(self) -> KVTransferParams:
        """Every prefill rank keeps the request's blocks (vLLM's step metadata); the
        params are rank 0's, as its scheduler hands them out."""
        kept = tuple(tuple(SRC_BLOCKS) for _ in self.kinds)
        for w in self.prefill:
            w.apply(HybridPDMetadata(sends=[Send(RID, "tok", kept)]))
        return handover_params(self.prefill[0].prefill, RID, kept, [5, 6, 7], 9, "tok")

    def load(self, d: int, params: KVTransferParams) -> str | None:
        """Decode rank d loads the request (vLLM's step metadata); its error or None."""
        dst = tuple(tuple(DST_BLOCKS) for _ in self.d_kinds)
        w = self.decode[d]
        w.apply(HybridPDMetadata(loads=[Load(RID, params, dst)]))
        done: dict = {}

        def ended() -> bool:
            res = w.results()
            done.update(dict.fromkeys(res.finished_recving, None))
            done.update(dict.fromkeys(res.failed_recving, "failed"))
            return RID in done

        assert _wait(ended), f"decode rank {d}'s load never ended"
        return None if done[RID] is None else w.decode.stats_snapshot()["last_error"]

    def sent(self, p: int) -> bool:
        """Whether prefill rank p reported the request sent (its blocks freed) by now."""
        res = self.prefill[p].results()
        self.freed += [(p, r) for r in res.finished_sending]
        return (p, RID) in self.freed

    def check_shards(self, d: int, d_size: int) -> None:
        for g, kind in enumerate(self.kinds):
            for layer in range(LAYERS):
                name = f"model.layers.{g * LAYERS + layer}.mixer"
                got = self.caches[d][name]
                want = kind.shard(self.fulls[g][layer], d_size, d)
                for t_got, t_want in zip(got, want, strict=True):
                    for s, b in zip(SRC_BLOCKS[1:], DST_BLOCKS, strict=True):
                        assert torch.equal(t_got[b], t_want[s]), (d, name, s, b)

    def close(self) -> None:
        for w in self.decode + self.prefill:
            w.close()


@pytest.fixture
def one_sided(monkeypatch):
    monkeypatch.setenv("HYBRID_PD_UCX_ONESIDED", "1")


@pytest.mark.parametrize(
    ("family", "p_size", "d_size"),
    [("granite", 1, 2), ("granite", 2, 1), ("attention", 1, 2), ("attention", 2, 1)],
)
def test_decode_ranks_pull_their_pieces_from_the_prefill_ranks(one_sided, family, p_size, d_size):
    """Granite-like: Mamba2's x channels split, so TP 2 -> 1 reads both prefill ranks.
    Attention with one KV head (held by every rank): TP 2 -> 1 reads rank 0 only, and
    prefill rank 1, which no decode rank reads, is released all the same."""
    kinds = KINDS if family == "granite" else [Attention(1)]
    ranks = _Ranks(p_size, d_size, kinds=kinds)
    sources = {("granite", 2, 1): 2}.get((family, p_size, d_size), 1)
    try:
        params = ranks.keep()
        for d in range(d_size):
            assert ranks.load(d, params) is None
            ranks.check_shards(d, d_size)
            stats = ranks.decode[d].decode.stats_snapshot()
            assert stats["pulls"] == sources  # one per prefill rank holding its pieces
            if d < d_size - 1:  # a rank still to read from prefill rank 0: kept for it
                time.sleep(0.3)
                assert not ranks.sent(0) and ranks.prefill[0].prefill.num_leases == 1
        # each prefill rank freed the blocks once every decode rank reading it released
        assert _wait(lambda: all(ranks.sent(p) for p in range(p_size)), 10)
        assert sorted(ranks.freed) == [(p, RID) for p in range(p_size)]
        read = [w.prefill.stats_snapshot() for w in ranks.prefill]
        want = [d_size] if p_size == 1 else [1, 1 if family == "granite" else 0]
        assert [s["read_pulls"] for s in read] == want
        assert [s["released"] for s in read] == [1] * p_size
        assert all(w.prefill.num_leases == 0 for w in ranks.prefill)
    finally:
        ranks.close()


def test_without_one_sided_reads_the_pair_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("HYBRID_PD_UCX_ONESIDED", "0")
    ranks = _Ranks(1, 2)
    try:
        error = ranks.load(0, ranks.keep())
        assert "HYBRID_PD_UCX_ONESIDED=1" in error and "refused the handshake" in error
        assert (ranks.caches[0]["model.layers.0.mixer"][0] == -7.0).all()
    finally:
        ranks.close()


def test_rows_that_do_not_map_are_refused_by_name(one_sided):
    ranks = _Ranks(1, 2, d_kinds=[Attention(1), mamba2(2)])  # another model's groups
    try:
        error = ranks.load(0, ranks.keep())
        assert "refused the handshake" in error and "group 1" in error
    finally:
        ranks.close()


def test_a_prefill_rank_whose_caches_are_not_as_described_refuses_the_handshake(one_sided):
    """Prefill's attention caches with K and V apart (a GPU backend's layout): its rows do
    not describe them, so it refuses decode ranks of another size by name at the
    handshake, before any byte is read."""
    ranks = _Ranks(1, 2, kinds=[Attention(1)], kv_apart=True)
    try:
        error = ranks.load(0, ranks.keep())
        assert "refused the handshake" in error and "not mapped between TP sizes" in error
        assert ranks.prefill[0].prefill.stats_snapshot()["read_pulls"] == 0
    finally:
        ranks.close()


def test_an_idle_step_waits_on_every_rank(one_sided, monkeypatch):
    """vLLM steps a server idle until every rank has reported its hand-offs ended. Prefill
    rank 1 still keeps a request, rank 0 keeps none (its decode reader released it): on an
    idle step both answer only after IDLE_WAIT_S, rank 1 at once when its lease ends. A
    rank that answered at once would spin in vLLM's loop until the next step, on the core
    it is bound to (TP 2 -> 1 on two CPUs: the core of the decode server's rank)."""
    monkeypatch.setattr(worker, "IDLE_WAIT_S", 2.0)  # long enough to tell the cases apart
    ranks = _Ranks(2, 1)
    try:
        kept = tuple(tuple(SRC_BLOCKS) for _ in ranks.kinds)
        holder = ranks.prefill[1]
        holder.apply(HybridPDMetadata(sends=[Send(RID, "tok", kept)]))
        steps = {}
        for p, w in enumerate(ranks.prefill + ranks.decode):
            w.apply(HybridPDMetadata(idle=True))
            t0 = time.monotonic()
            if w is holder:  # its lease ends 0.3 s into the wait
                threading.Timer(0.3, holder.prefill.release, (RID, "tok")).start()
            res = w.results()
            steps[p] = (time.monotonic() - t0, sorted(res.finished_sending))
        assert steps[0][0] >= 1.9 and steps[2][0] >= 1.9, steps  # prefill 0, decode 0
        assert 0.25 < steps[1][0] < 1.5 and steps[1][1] == [RID], steps
        # a step that computes does not wait
        ranks.prefill[0].apply(HybridPDMetadata(idle=False))
        t0 = time.monotonic()
        ranks.prefill[0].results()
        assert time.monotonic() - t0 < 1.0
    finally:
        ranks.close()
