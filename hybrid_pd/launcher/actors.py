"""Ray actors: thin shells over `Worker` (all logic lives in the plain class)."""

from __future__ import annotations

from hybrid_pd.launcher.console import configure_logging, name_log_prefix
from hybrid_pd.roles import build_worker
from hybrid_pd.workers.config import WorkerConfig


class WorkerActor:
    """Wrapped with `ray.remote` by the launcher; one worker process per actor.

    `name` (e.g. `prefill-0`) is its `repr`, which Ray puts in front of every line the actor
    writes when it forwards them to the driver's console: `(prefill-0 pid=...) ...`; it is
    announced first thing, so that the lines of model loading carry it too."""

    def __init__(
        self,
        config: WorkerConfig,
        threads: int | None = None,
        *,
        name: str = "worker",
        log_level: str = "info",
        workers_on_host: int | None = None,
    ) -> None:
        """`threads`: torch threads (None: this process's CPUs shared by `workers_on_host`,
        by default the worker slots of this Ray node)."""
        self.name = name
        name_log_prefix(name)
        configure_logging(log_level)  # stderr, which Ray forwards to `serve`'s console
        from hybrid_pd.engine.malloc import tune_malloc
        from hybrid_pd.engine.threads import set_torch_threads

        if not threads and workers_on_host is None:
            workers_on_host = _worker_slots_on_this_node()
        set_torch_threads(threads, workers_on_host or 1)
        tune_malloc()
        if config.host == "auto":  # serve on this node's address (multi-node clusters)
            import dataclasses

            import ray

            config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        self.worker = build_worker(config)
        from hybrid_pd.engine.heap import freeze_startup_heap

        freeze_startup_heap()

    def __repr__(self) -> str:
        return self.name

    def address(self) -> str:
        return self.worker.address

    def health(self) -> dict:
        """The worker's stats; raises if the pool's invariants do not hold."""
        return self.worker.stats()

    def shutdown(self) -> None:
        self.worker.close()


def _worker_slots_on_this_node() -> int:
    """Worker slots (its `prefill` + `decode` resources) of the Ray node this actor is on:
    the engine processes that may share its CPUs. 1 when Ray cannot tell."""
    import ray

    if not ray.is_initialized():  # a plain object, not an actor (tests)
        return 1
    try:
        node = ray.get_runtime_context().get_node_id()
        for info in ray.nodes():
            if info.get("NodeID") == node:
                res = info.get("Resources", {})
                return max(1, int(res.get("prefill", 0) + res.get("decode", 0)))
    except Exception:  # a thread count's guess is no reason for a worker to fail
        pass
    return 1


class VllmWorkerActor:
    """A vLLM OpenAI server running hybrid-pd's connector (a subprocess under
    `vllm_python`), and the Worker gRPC API in front of it (`VllmWorker`). A prefill actor
    serves KVControl on `control_port`, fixed by the launcher so that a restarted actor
    comes back where its decode peers look for it; with `tensor_parallel_size` N its
    server runs N ranks on this node (rank r serving KVControl on `control_port + r`),
    bound to `cpus` ("0|1": one entry per rank; "node": this node's CPUs split among
    them, refused when there are fewer than ranks)."""

    def __init__(
        self,
        role: str,
        model: str,
        *,
        name: str,
        log_level: str = "info",
        vllm_python: str,
        dtype: str,
        secret: str | None,
        control_port: int = 0,
        peers: tuple[str, ...] = (),
        cpus: str = "nobind",
        host: str = "127.0.0.1",
        ucx_tls: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        import os
        import tempfile
        from pathlib import Path

        from hybrid_pd.workers.vllm_server import VllmServer
        from hybrid_pd.workers.vllm_worker import VllmWorker

        self.name = name
        name_log_prefix(name)
        configure_logging(log_level)
        log = Path(tempfile.mkdtemp(prefix=f"hybrid-pd-{name}-")) / "vllm.log"
        if host == "auto":  # serve on this node's address (multi-node clusters)
            import ray

            host = ray.util.get_node_ip_address()
        if cpus == "node":  # every CPU this node gives the actor, split among its ranks
            from hybrid_pd.launcher.vllm_slots import rank_binds

            mine = sorted(os.sched_getaffinity(0))
            cpus = rank_binds(mine, [tensor_parallel_size], where=f"node {host}")[0]
        extra: dict = {"control_host": host, "control_port": control_port}
        if peers:
            extra["peers"] = list(peers)
        env = {"HYBRID_PD_SECRET": secret} if secret else {}
        if ucx_tls:
            env["UCX_TLS"] = ucx_tls
        self.server = VllmServer(
            Path(model),
            log,
            dtype=dtype,
            role="kv_producer" if role == "prefill" else "kv_consumer",
            extra=extra,
            cpus=cpus,
            env=env,
            python=vllm_python,
            tensor_parallel_size=tensor_parallel_size,
        )
        try:
            self.server.wait_ready()
        except BaseException:
            self.server.stop()
            raise
        self.control_address = f"{host}:{control_port}" if role == "prefill" else ""
        self.worker = VllmWorker(self.server.url, role, model, host=host, secret=secret)
        self.server.watch(self._server_ended)

    def _server_ended(self, code: int) -> None:
        """The vLLM server ended by itself (it crashed, or one of its tensor-parallel ranks
        died and vLLM stopped it): this actor ends too, at once, so that its requests
        migrate or retry elsewhere and Ray (or `serve`'s supervisor) re-creates the worker
        whole, with a fresh server. Staying up would leave a worker that answers nothing."""
        import logging
        import os

        logging.getLogger(__name__).critical(
            "%s: its vLLM server exited (code %s): this worker stops\n%s",
            self.name,
            code,
            self.server.first_error(),
        )
        try:  # what the dead server left (its temp folder, a TP server's shared memory)
            self.server.stop()
        finally:
            logging.shutdown()
            os._exit(70)

    def __repr__(self) -> str:
        return self.name

    def address(self) -> str:
        return self.worker.address

    def control(self) -> str:
        """The KVControl address of a prefill server's connector ("" for decode)."""
        return self.control_address

    def health(self) -> dict:
        """What the launcher logs and checks: the server must answer."""
        r = self.server.client.get("/health", timeout=5.0)
        r.raise_for_status()
        return {
            "engine_id": self.worker.engine_id,
            "vllm_url": self.server.url,
            "server_pid": self.server.proc.pid,  # its process group's id too
            "server_temp_dir": str(self.server.temp_dir),  # what stop() removes
        }

    def shutdown(self) -> None:
        self.worker.close()
        self.server.stop()
