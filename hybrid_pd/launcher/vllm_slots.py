"""Per worker slot of `serve --engine vllm`, the arguments of its VllmWorkerActor: the vLLM
Python and dtype, the secret, the host, the CPUs it binds and its control port."""

from __future__ import annotations

from hybrid_pd.launcher.serve_config import ServeConfig


def vllm_slots(config: ServeConfig, model_path: str) -> dict[tuple[str, int], dict]:
    """Per worker slot, the VllmWorkerActor arguments besides role and model: the vLLM
    Python and dtype, the secret, the host to serve on, CPUs of its own (vLLM CPU servers
    bind their compute threads: servers sharing cores slow each other down by orders of
    magnitude), and fixed control ports (a restarted prefill actor comes back where its
    decode peers look). With a fixed host (embedded Ray, or --worker-host) decode slots get
    their peers here; with "auto" they learn them once the prefill actors are up.

    Embedded Ray: this machine's CPUs are split among the servers. A cluster: each server
    binds the CPUs of the node it lands on (one vLLM server per node, see docs/vllm.md)."""
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
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // len(order)  # 0: fewer CPUs than servers, so none is bound
    slots: dict[tuple[str, int], dict] = {}
    for k, (role, i) in enumerate(order):
        mine = ",".join(map(str, cpus[k * share : (k + 1) * share])) or "nobind"
        slot = {**common, "cpus": mine if embedded else "node"}
        if role == "prefill":
            slot["control_port"] = free_port()
        slots[(role, i)] = slot
    if common["host"] != "auto":  # where each prefill actor's connector will listen
        peers = tuple(
            f"{common['host']}:{slot['control_port']}"
            for (role, _), slot in slots.items()
            if role == "prefill"
        )
        for (role, _), slot in slots.items():
            if role == "decode":
                slot["peers"] = peers
    return slots
