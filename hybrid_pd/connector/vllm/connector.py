"""`HybridPDConnector`: the class vLLM loads, `KVConnectorBase_V1` + `SupportsHMA`.

vLLM makes one in its scheduler process (role SCHEDULER) and one in each worker process
(role WORKER) and calls the methods of that side; each side's work is its half's:

    scheduler side  ──►  SchedulerHalf (scheduler.py)   decides, builds the step's metadata
    worker side     ──►  WorkerHalf (worker.py)         moves bytes, made at register_kv_caches
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from hybrid_pd.connector.vllm.clip import BlockClipper
from hybrid_pd.connector.vllm.first_token import FirstTokens
from hybrid_pd.connector.vllm.first_token import install as install_first_tokens
from hybrid_pd.connector.vllm.layout import layout_of
from hybrid_pd.connector.vllm.metadata import HybridPDHandshake, HybridPDMetadata
from hybrid_pd.connector.vllm.metrics import HybridPDPromMetrics, HybridPDStats
from hybrid_pd.connector.vllm.options import ConnectorOptions, read_secret
from hybrid_pd.connector.vllm.pinning import io_cpus, unpinned
from hybrid_pd.connector.vllm.plan import VllmPlan
from hybrid_pd.connector.vllm.scheduler import SchedulerHalf
from hybrid_pd.connector.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class HybridPDConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.options = ConnectorOptions.parse(tc.kv_connector_extra_config)
        self.engine_id = str(tc.engine_id)
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self.layout = layout_of(vllm_config, kv_cache_config)
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
            raise ValueError("the hybrid-pd connector does not support pipeline parallelism")
        if self.layout.tp_size > 1 and self.is_producer and not self.options.control_port:
            raise ValueError(
                "kv_connector_extra_config: with tensor parallelism a prefill server needs a "
                "fixed control_port (rank r serves KV control on control_port + r)"
            )
        self.secret = read_secret(self.options)
        if self.secret is None:
            logger.warning(
                "hybrid-pd connector: no secret (secret_file or HYBRID_PD_SECRET); the KV "
                "control plane is open to any local process"
            )
        options = self.options
        control_bind = f"{options.control_host}:{options.control_port}"
        self._scheduler = SchedulerHalf(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            engine_id=self.engine_id,
            layout=self.layout,
            clipper=BlockClipper(kv_cache_config),
            is_producer=self.is_producer,
            control_address=control_bind if options.control_port else None,
            peers=options.peers,
            secret=self.secret,
            lease_s=options.lease_s,
        )
        self._worker: WorkerHalf | None = None  # made at register_kv_caches
        #: First tokens owed to decode replies (`first_token`): vLLM's scheduler, consumers.
        self.first_tokens: FirstTokens | None = None
        if self.is_consumer and role == KVConnectorRole.SCHEDULER:
            self.first_tokens = self._scheduler.first_tokens
            install_first_tokens()

    # == scheduler side =======================================================================
    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._scheduler.get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self._scheduler.set_xfer_handshake_metadata(metadata)

    # == worker side ==========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        plan = VllmPlan(self._kv_cache_config, kv_caches)
        cpus = io_cpus()
        rank = _tp_rank() if self.layout.tp_size > 1 else 0
        with unpinned(cpus):  # the threads it starts stay off the compute cores
            self._worker = WorkerHalf(
                engine_id=self.engine_id,
                layout=self.layout,
                options=self.options.for_rank(rank),
                rank=rank,
                secret=self.secret,
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                plan=plan,
                cpus=cpus,
                base_peers=self.options.peers,
            )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.control_address is None:
            return None
        return HybridPDHandshake(self._worker.control_address)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, HybridPDMetadata)
            self._worker.apply(meta)
        elif self._worker is not None:
            self._worker.idle = False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return  # prefill's blocks stay where they are; decode pulls them

    def get_finished(self, finished_req_ids: set[str]):
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.results()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = HybridPDStats(self._worker.stats_delta())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return HybridPDStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HybridPDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failed loads are reported per request (failed_recving)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def _tp_rank() -> int:
    """This worker process's tensor-parallel rank in its vLLM server."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
