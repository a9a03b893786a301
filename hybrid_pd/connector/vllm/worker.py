"""The worker half of the vLLM connector (vLLM's model-runner process): it moves bytes.

Made at `register_kv_caches`: the UCX transport and, on a producer, the KVControl server with
the prefill half (keeps leased blocks, serves pulls); on a consumer, the decode half (pulls
into the blocks the scheduler allocated). Each step it applies the scheduler's metadata and
reports finished sends and loads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from hybrid_pd.connector import timeline
from hybrid_pd.connector.base import TransferFailed
from hybrid_pd.connector.layout import KVLayout
from hybrid_pd.connector.vllm.metadata import HybridPDMetadata
from hybrid_pd.connector.vllm.metrics import COUNTERS
from hybrid_pd.connector.vllm.options import ConnectorOptions, rank_address
from hybrid_pd.connector.vllm.pinning import unpinned
from hybrid_pd.connector.vllm.plan import VllmPlan
from hybrid_pd.connector.vllm.tp_sources import RankSources
from hybrid_pd.kvcache.ids import EngineId, RequestId

logger = logging.getLogger(__name__)

#: Start-up handshakes with configured peers: tries and their period (a peer server that
#: starts alongside this one answers within a few minutes).
_DIAL_TRIES = 300
_DIAL_PERIOD_S = 1.0
#: How long an idle step waits for one of this rank's transfers to end before it reports
#: (see `results`).
IDLE_WAIT_S = 0.005


class WorkerHalf:
    """Transport, control server and the two connector halves of one vLLM worker."""

    def __init__(
        self,
        *,
        engine_id: EngineId,
        layout: KVLayout,
        options: ConnectorOptions,
        secret: str | None,
        is_producer: bool,
        is_consumer: bool,
        plan: VllmPlan,
        cpus: set[int] | None,
        rank: int = 0,
        base_peers: tuple[str, ...] = (),
    ) -> None:
        """`rank`: this process's tensor-parallel rank; it moves its own shard with the
        peer server's rank of the same number, or, the sizes differing, with the peer
        ranks holding its pieces (`tp_sources`). `options` are already this rank's;
        `base_peers`: the configured peers' rank-0 addresses."""
        from hybrid_pd.connector.decode import DecodeConnector
        from hybrid_pd.connector.prefill import PrefillConnector
        from hybrid_pd.connector.setup import add_kv_control, open_server, start_transport

        self._cpus = cpus
        self.rank = rank
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._reported = dict.fromkeys(COUNTERS, 0)
        self._load_failures = 0
        self._closing = threading.Event()
        #: Set when a load ends or kept blocks are freed: what an idle step waits for.
        self._ended = threading.Event()
        #: Whether this step computes nothing (`HybridPDMetadata.idle`).
        self.idle = False
        #: Timeline: loads running, this server's request id -> the prefill's.
        self._loading: dict[str, str] = {}
        self.sources = RankSources(layout, rank, plan.views)
        host = options.control_host
        self.transport = start_transport(host)
        self.prefill = self.decode = self.server = None
        self.control_address: str | None = None
        if is_producer:
            self.server, self.control_address = open_server(host, options.control_port, secret)
            self.prefill = PrefillConnector(
                engine_id=engine_id,
                layout=layout,
                control_address=self.control_address,
                free_blocks=self._freed,
                transport=self.transport,
                plan=plan,
                lease_s=options.lease_s,
                # The engine core hands params out before this process keeps the blocks (at
                # its next step): a pull that comes first waits this long for the keep.
                keep_wait_s=options.keep_wait_s,
                rank_plans=self.sources.prefill_plan,
            )
            add_kv_control(self.server, engine_id, layout, self.transport, self.prefill)
            self.server.start()
            logger.info("hybrid-pd connector: KV control on %s", self.control_address)
        if is_consumer:
            self.decode = DecodeConnector(
                engine_id=engine_id,
                layout=layout,
                transport=self.transport,
                plan=plan,
                secret=secret,
                timeout_s=options.timeout_s,
                peers=tuple(dict.fromkeys(options.peers + base_peers)),
                # pack a pull's runs of blocks into a few scatter-gather UCX messages
                scatter_gather=options.scatter_gather,
                rank_plans=self.sources.decode_plan,
            )
            self.sources.decode = self.decode
            self.decode.notify = self._ended.set
            bases = base_peers or options.peers
            if bases:  # shake hands now: the first request does not pay for it
                threading.Thread(
                    target=self._dial, args=(bases,), name="kv-dial", daemon=True
                ).start()

    def _dial(self, bases: tuple[str, ...]) -> None:
        """Handshake with each configured prefill server's rank 0 and the ranks this rank
        pulls from, retrying while it starts (at most `_DIAL_TRIES` times,
        `_DIAL_PERIOD_S` apart); one that never answers is dialed by its first pull."""
        for base in bases:
            for _ in range(_DIAL_TRIES):
                try:
                    found = self.sources.dial(base)
                    logger.info("hybrid-pd connector: shook hands with %s", ", ".join(found))
                    break
                except TransferFailed as e:
                    if "refused the handshake" in str(e):
                        logger.warning("hybrid-pd connector: %s", e)
                        break
                except Exception as e:  # closed meanwhile
                    logger.debug("dialing %s stopped: %s", base, e)
                    return
                if self._closing.wait(_DIAL_PERIOD_S):
                    return

    def _freed(self, request_id: RequestId) -> None:  # lease released, aborted or expired
        with self._lock:
            self._sent.add(request_id)
        self._ended.set()

    def apply(self, meta: HybridPDMetadata) -> None:
        self.idle = meta.idle
        if not (meta.sends or meta.loads or meta.drops):
            return
        with unpinned(self._cpus):  # pull and control threads start here, on first use
            self._apply(meta)

    def _apply(self, meta: HybridPDMetadata) -> None:
        for s in meta.sends:
            if self.prefill is None:
                raise RuntimeError("a kv_consumer was asked to keep KV for a decode server")
            self.prefill.keep(s.request_id, s.token, s.block_ids)
            timeline.stamp(s.request_id, "kept")
        for ld in meta.loads:
            if self.decode is None:
                raise RuntimeError("a kv_producer was asked to load KV")
            if timeline.enabled():
                timeline.stamp(ld.params.request_id, "load_applied")
                self._loading[ld.request_id] = ld.params.request_id
            self.decode.start_load_kv(
                ld.request_id, ld.params, ld.block_ids, sources=self.sources.sources
            )
        for params in meta.drops:
            if self.decode is None:
                continue
            # the prefill ranks this rank reads from, where their server's size is known
            for p in self.sources.known_sources(params) or [self._ranked(params)]:
                try:  # a known peer, or one the params vouch for: it frees the blocks now
                    self.decode.admission.admit(p)
                except TransferFailed:
                    continue  # else its lease expires on its own
                self.decode.abort_later(p)

    def _ranked(self, params):
        """The params as this rank's pull needs them: the prefill server's same rank."""
        if self.rank == 0:
            return params
        address = rank_address(params.control_address, self.rank)
        if self.decode is not None and params.signature:
            # rank 0's signed params vouch for the same server's rank `rank` (the
            # re-addressed params' signature no longer matches their address)
            try:
                self.decode.admission.admit(params, address)
            except TransferFailed:
                pass  # the pull fails, saying why
        return dataclasses.replace(params, control_address=address)

    def results(self) -> KVConnectorTransferResults:
        """What ended since the last step. An idle step first waits up to IDLE_WAIT_S for
        one of this rank's transfers to end (woken at once when one does), whether or not
        this rank has one in flight. vLLM steps idle in a loop while any hand-off is in
        flight, and until every rank has reported its own ended: a rank that answered at
        once would spin in vLLM's loop until the next step, on the core it is bound to.
        With servers sharing cores that starved the other server's rank on that core, and
        with it the Release that would have ended the loop, until the lease expired."""
        if self.idle:
            self._ended.wait(IDLE_WAIT_S)
        self._ended.clear()
        res = KVConnectorTransferResults()
        if self.prefill is not None:
            self.prefill.expire()
            with self._lock:
                res.finished_sending, self._sent = self._sent, set()
        if self.decode is not None:
            for r in self.decode.get_finished():
                res.finished_recving.add(r.request_id)
                if self._loading:
                    timeline.stamp(self._loading.pop(r.request_id, r.request_id), "reported")
                if r.error is not None:
                    res.failed_recving.add(r.request_id)
                    self._load_failures += 1
        return res

    def totals(self) -> dict[str, float]:
        out = dict.fromkeys(COUNTERS, 0)
        if self.decode is not None:
            st = self.decode.stats_snapshot()
            out.update(
                pulls=st["pulls"],
                pull_failures=self._load_failures,
                bytes_pulled=st["bytes"],
                messages_pulled=st["messages"],
                pull_seconds=st["seconds"],
            )
        if self.prefill is not None:
            st = self.prefill.stats_snapshot()
            out.update(
                handed_over=st["handed_over"],
                pulled_from=st["pulled"],
                bytes_sent=st["bytes_sent"],
                read_pulls=st["read_pulls"],
                released=st["released"],
                expired=st["expired"],
                aborted=st["aborted"],
            )
        return out

    def stats_delta(self) -> dict[str, float]:
        now = self.totals()
        delta = {k: now[k] - self._reported[k] for k in COUNTERS}
        self._reported = now
        return delta

    def close(self) -> None:
        self._closing.set()
        if self.server is not None:
            self.server.stop(grace=1.0)
        if self.prefill is not None:
            self.prefill.close()
        if self.decode is not None:
            self.decode.close()
        self.transport.close()
