"""`hybrid-pd serve`: prefill and decode pools as Ray actors, and the proxy in front.

the CPU kernels' build, begun in a thread (embedded Ray, our engine on the CPU): it runs
  while Ray starts and the workers load; they find it built, or wait for it
ray.init (embedded local instance, or --address of a cluster)
N prefill actors (resource "prefill"), M decode actors (resource "decode")
proxy on host:port routing through their gRPC addresses
supervisor: follows actor restarts (new addresses) and reports health; re-creates an actor that
  Ray will not bring back (restart budget spent, node gone), a bounded number of times, and
  otherwise marks the deployment failed (`serve` then exits non-zero, never sits in 503s)

Control plane: every worker RPC needs the shared secret. Embedded mode makes one when none is
given; joining a cluster without one is refused unless `insecure` is set (serve_config.py).

Console: each step of the start is logged (Ray up, each worker loading, then ready with its
address and KV capacity, the proxy's URL); the workers' own lines come through Ray under
their names (`(prefill-0 pid=...)`); `close` drains the proxy before the workers stop.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from hybrid_pd.launcher.ray_auth import close_embedded_ray
from hybrid_pd.launcher.ray_state import _actor_state, _death_cause, _node_gone, _one_line
from hybrid_pd.launcher.serve_config import ServeConfig
from hybrid_pd.launcher.vllm_slots import vllm_slots as _vllm_slots

__all__ = ["Deployment", "Interrupted", "ServeConfig", "wait_ready"]

logger = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost")


class Deployment:
    """A running service: Ray actors, the proxy, and the supervisor thread.

    `failed` is set (and `failure` says why, in one line naming the pool) once a worker is
    lost for good: Ray will not restart its actor and `max_recreates` fresh actors did not
    bring it back either. `on_failure(reason)` is called then, from the supervisor thread."""

    #: Seconds the supervisor waits for the workers' addresses in one round.
    probe_timeout_s = 10.0

    def __init__(
        self,
        config: ServeConfig,
        *,
        on_failure: Callable[[str], None] | None = None,
        supervise_every_s: float = 2.0,
        interrupt: threading.Event | None = None,
    ) -> None:
        """Starts Ray, the workers and the proxy, logging each step. Setting `interrupt`
        while it starts (a SIGTERM, say) stops what was started and raises Interrupted."""
        import ray

        from hybrid_pd.engine.tiny import TINY_NAME, resolve_model
        from hybrid_pd.launcher.actors import VllmWorkerActor, WorkerActor

        config = config.resolved()  # the secret: given, generated (embedded) or refused
        self.config = config
        self._kernels_build = _build_kernels_ahead(config)
        self.failed = threading.Event()
        self.failure: str | None = None
        self._on_failure = on_failure
        self._every_s = supervise_every_s
        self._stop = threading.Event()
        self.health: dict[str, Any] = {}
        # Per worker slot (role, index): unreachable since, why, fresh actors made so far.
        self._down_since: dict[tuple[str, int], float] = {}
        self._down_reason: dict[tuple[str, int], str] = {}
        self._recreates: dict[tuple[str, int], int] = {}
        model_path = str(resolve_model(config.model))  # builds `tiny` once, before workers
        # Each worker resolves `tiny` on its own node (built there if missing); a checkpoint
        # path must exist at the same place on every node.
        self._worker_model = config.model if config.model == TINY_NAME else model_path
        vllm = config.engine == "vllm"
        # before Ray starts: a TP size this host's CPUs cannot bind is refused here
        self._vllm_args = _vllm_slots(config, model_path) if vllm else {}
        self._init_ray()
        self._gpu = 1 if (config.device or "").startswith("cuda") else 0
        self._remote = ray.remote(VllmWorkerActor if vllm else WorkerActor)
        self.actors: dict[str, list] = {"prefill": [], "decode": []}
        try:
            # vLLM decode servers are told their prefill peers when they start: where the
            # peers' addresses are known up front (a fixed host) all start at once, else
            # prefill first (its actors say where they landed).
            serial = vllm and any("peers" not in a for a in self._vllm_args.values())
            stages = [("prefill",), ("decode",)] if serial else [("prefill", "decode")]
            self.addresses = {"prefill": [], "decode": []}
            for stage in stages:
                for role in stage:
                    for i in range(config.prefill if role == "prefill" else config.decode):
                        logger.info("%s-%d: starting, loading model %s", role, i, config.model)
                        self.actors[role].append(self._spawn(role, i))
                up = self._await_workers(timeout=300, interrupt=interrupt, roles=stage)
                self.addresses.update(up)
                if serial and stage == ("prefill",):
                    self._tell_decode_its_peers()
            self._start_proxy(model_path)
        except BaseException:
            self._kill_actors()
            ray.shutdown()
            if self._kernels_build is not None:  # its compilers end within seconds
                self._kernels_build.join(timeout=_KERNELS_JOIN_S)
            raise
        logger.info("proxy: listening on %s (OpenAI API under /v1, metrics at /metrics)", self.url)
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()

    def _init_ray(self) -> None:
        """Embedded local Ray, or join the cluster at `address`. Workers' output reaches this
        console (log_to_driver); Ray's own Python logging only for errors (from info up at
        log level debug). Ray's driver replaces the process's SIGTERM handler with one that
        exits with status 15 (after a stack dump from its core): handlers the process had set
        are put back."""
        import ray

        config = self.config
        quiet = logging.INFO if config.log_level == "debug" else logging.ERROR
        saved = _own_signal_handlers()
        common = {"log_to_driver": True, "logging_level": quiet}
        if config.address is None:
            # Ray listens on every interface whatever it is asked: a token closes it
            if close_embedded_ray():
                logger.info("Ray: token authentication on, with a token made for this run")
            context = ray.init(
                address="local",  # always a new instance, even if another one runs here
                include_dashboard=False,
                resources={"prefill": config.prefill, "decode": config.decode},
                num_cpus=max(2, config.engine_processes),
                **common,
            )
        else:
            context = ray.init(address=config.address, **common)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        info = context.address_info
        where = info.get("gcs_address", config.address)
        if config.address is None:
            how = f"started an embedded local instance at {where}"
        else:
            how = f"joined the cluster at {where} ({len(ray.nodes())} nodes)"
        logger.info("Ray: %s, its logs in %s/logs", how, info.get("session_dir", "?"))

    def _tell_decode_its_peers(self) -> None:
        """vLLM decode servers dial the prefill servers their connector config names: the
        control addresses the prefill actors serve (on their nodes) become every decode
        slot's peers, kept for re-created actors too."""
        import ray

        peers = tuple(ray.get([a.control.remote() for a in self.actors["prefill"]], timeout=60))
        for (role, _), args in self._vllm_args.items():
            if role == "decode":
                args["peers"] = peers

    def _spawn(self, role: str, index: int):
        if self._vllm_args:
            # the actor's vLLM server starts its ranks as its own child processes, so a
            # worker's ranks are on one node; it holds the devices of all of them
            return self._remote.options(
                resources={role: 1},
                num_cpus=0,
                num_gpus=self._gpu * self.config.tp_size(role),
                max_restarts=self.config.max_restarts,
            ).remote(
                role,
                self._worker_model,
                name=f"{role}-{index}",
                log_level=self.config.log_level,
                **self._vllm_args[(role, index)],
            )
        # one actor per worker: rank 0, which starts the worker's other ranks on its own
        # node (a one-bundle placement); it holds the devices of all of them
        return self._remote.options(
            resources={role: 1},
            num_cpus=0,
            num_gpus=self._gpu * self.config.tp_size(role),
            max_restarts=self.config.max_restarts,
            max_task_retries=0,
        ).remote(
            self.config.worker_config(role, self._worker_model),
            self.config.threads,
            name=f"{role}-{index}",
            log_level=self.config.log_level,
            # embedded Ray: every worker is on this host; on a cluster each actor counts
            # the worker slots of its own node
            workers_on_host=(self.config.engine_processes if self.config.address is None else None),
        )

    def _start_proxy(self, model_path: str) -> None:
        from hybrid_pd.proxy.config import ProxyConfig
        from hybrid_pd.proxy.routing import WorkerPool
        from hybrid_pd.proxy.server import DRAIN_S, ProxyHandle

        config = self.config
        proxy_config = ProxyConfig(
            host=config.host,
            port=config.port,
            served_model_names=config.served_model_names,
            model_path=model_path,
            prefill_addresses=tuple(self.addresses["prefill"]),
            decode_addresses=tuple(self.addresses["decode"]),
            secret=config.secret,
            min_prefill_tokens=config.min_prefill_tokens,
            max_pending_requests=config.max_pending,
            queue_timeout_s=config.queue_timeout_s,
            max_fallback_prefills=config.max_fallback_prefills,
            max_migrations=config.max_migrations,
            kv_routing=config.kv_routing,
            overlap_transfer=config.overlap_transfer,
        )
        self.pool = WorkerPool.from_config(proxy_config)
        self.proxy = ProxyHandle(proxy_config, self.pool, drain_s=DRAIN_S).start()

    @property
    def url(self) -> str:
        return self.proxy.url

    def _await_workers(
        self,
        timeout: float,
        interrupt: threading.Event | None,
        roles: tuple[str, ...] = ("prefill", "decode"),
    ) -> dict[str, list[str]]:
        """Every worker's gRPC address, waiting until each has loaded its model; each is
        logged as it comes up, with its KV capacity. Raises the actor's own error when one
        fails to start, TimeoutError past `timeout`, Interrupted once `interrupt` is set."""
        import ray

        pending = {
            actor.address.remote(): (role, i)
            for role in roles
            for i, actor in enumerate(self.actors[role])
        }
        out: dict[str, list[str]] = {role: [""] * len(self.actors[role]) for role in roles}
        deadline = time.monotonic() + timeout
        while pending:
            if interrupt is not None and interrupt.is_set():
                raise Interrupted("stopped before the workers were up")
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(sorted(f"{r}-{i}" for r, i in pending.values()))
                raise TimeoutError(f"workers not up within {timeout:.0f} s: {names}")
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(0.5, left))
            for ref in done:
                role, i = pending.pop(ref)
                out[role][i] = ray.get(ref)  # an actor that failed to start raises here
                self._log_ready(role, i, out[role][i])
        return out

    def _log_ready(self, role: str, i: int, address: str) -> None:
        import ray

        try:
            stats = ray.get(self.actors[role][i].health.remote(), timeout=30)
        except Exception as e:  # up, but not answering (yet): say so, go on
            logger.info("%s-%d: ready at %s (no stats: %s)", role, i, address, _one_line(e, 120))
            return
        if "num_blocks" not in stats:  # a vLLM server: its own cache
            logger.info(
                "%s-%d: ready at %s (engine %s, vLLM server at %s)",
                role,
                i,
                address,
                stats.get("engine_id", "?"),
                stats.get("vllm_url", "?"),
            )
            return
        blocks = int(stats["num_blocks"]) - 1  # block 0 is the null block
        size = int(stats["block_size"])
        logger.info(
            "%s-%d: ready at %s (engine %s), KV cache %d blocks x %d tokens = %d token slots",
            role,
            i,
            address,
            stats.get("engine_id", "?"),
            blocks,
            size,
            blocks * size,
        )

    # -- supervision ------------------------------------------------------------------------
    def _supervise(self) -> None:
        """Every few seconds: follow restarted actors to their new addresses, record health,
        and replace or give up on workers Ray will not bring back."""
        failing_since: float | None = None
        while not self._stop.wait(self._every_s) and not self.failed.is_set():
            try:
                self._supervise_once()
                failing_since = None
            except Exception as e:  # e.g. the cluster's head is unreachable
                logger.warning("supervisor round failed: %s", e)
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self.config.restore_timeout_s:
                    self._fail(f"the Ray cluster is unreachable: {_one_line(e)}")

    def _supervise_once(self) -> None:
        import ray

        now = time.monotonic()
        probes = {}
        for role, actors in self.actors.items():
            for i, actor in enumerate(actors):
                state, info = _actor_state(actor)
                if state == "DEAD":
                    self._lost(
                        (role, i),
                        f"is dead for good after {info.get('NumRestarts', '?')} restarts "
                        f"(max_restarts {self.config.max_restarts}): {_death_cause(info)}",
                    )
                elif state not in (None, "ALIVE"):
                    self._mark_down((role, i), now, f"actor {state.lower()}{_node_gone(info)}")
                else:
                    probes[(role, i)] = actor.address.remote()
                if self.failed.is_set():
                    return
        fresh = {role: list(addresses) for role, addresses in self.addresses.items()}
        deadline = time.monotonic() + self.probe_timeout_s
        for key, ref in probes.items():
            try:
                address = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # restarting, or not answering
                self._mark_down(key, now, _one_line(e, 120))
                continue
            self._down_since.pop(key, None)
            self._down_reason.pop(key, None)
            fresh[key[0]][key[1]] = address
        for key, since in list(self._down_since.items()):
            if now - since > self.config.restore_timeout_s:
                waited = self.config.restore_timeout_s
                self._lost(key, f"is not back within {waited:.0f} s ({self._down_reason[key]})")
                if self.failed.is_set():
                    return
        if fresh != self.addresses:
            logger.warning("worker set changed: %s -> %s", self.addresses, fresh)
            self.pool.sync(fresh["prefill"], fresh["decode"], secret=self.config.secret)
            self.addresses = fresh
        for role, actors in self.actors.items():
            for i, actor in enumerate(actors):
                if self._stop.is_set():
                    return
                if (role, i) in self._down_since:
                    self.health[f"{role}-{i}"] = {"error": self._down_reason[(role, i)]}
                    continue
                try:
                    self.health[f"{role}-{i}"] = ray.get(actor.health.remote(), timeout=10)
                except Exception as e:
                    self.health[f"{role}-{i}"] = {"error": str(e)}

    def _mark_down(self, key: tuple[str, int], now: float, reason: str) -> None:
        self._down_since.setdefault(key, now)
        self._down_reason[key] = reason

    def _lost(self, key: tuple[str, int], reason: str) -> None:
        """The worker in slot `key` will not come back by itself: a fresh actor takes its
        place while re-creations are left, else the deployment fails."""
        import ray

        role, i = key
        name = f"{role}-{i}"
        used, budget = self._recreates.get(key, 0), self.config.max_recreates
        if used >= budget:
            spent = f"all {budget} re-creations spent" if budget else "re-creation is off"
            self._fail(f"the {role} pool cannot be restored: {name} {reason}; {spent}")
            return
        logger.warning("%s %s: re-creating it (%d of %d)", name, reason, used + 1, budget)
        try:
            ray.kill(self.actors[role][i], no_restart=True)
        except Exception:  # already gone
            pass
        try:
            self.actors[role][i] = self._spawn(role, i)
        except Exception as e:
            self._fail(
                f"the {role} pool cannot be restored: {name} {reason}; "
                f"re-creating it failed: {_one_line(e)}"
            )
            return
        self._recreates[key] = used + 1
        self._down_since[key] = time.monotonic()  # the fresh actor gets the whole timeout
        self._down_reason[key] = f"re-created ({used + 1} of {budget}) after it {reason}"

    def _fail(self, reason: str) -> None:
        if self.failed.is_set():
            return
        self.failure = _one_line(reason, 1000)
        logger.error("%s", self.failure)
        self.failed.set()
        if self._on_failure is not None:
            self._on_failure(self.failure)

    def worker_stats(self) -> dict[str, dict]:
        import ray

        return {
            f"{role}-{i}": ray.get(a.health.remote(), timeout=30)
            for role, actors in self.actors.items()
            for i, a in enumerate(actors)
        }

    def _kill_actors(self) -> None:
        import ray

        for actors in self.actors.values():
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # already gone
                    pass

    def close(self) -> None:
        """Stop taking connections, let requests in flight finish (up to the proxy's
        DRAIN_S), then stop the workers and Ray (an embedded instance ends; a cluster is only
        left)."""
        import ray

        from hybrid_pd.proxy.server import DRAIN_S

        self._stop.set()
        logger.info("stopping: no new connections; requests in flight get up to %d s", DRAIN_S)
        self.proxy.stop()
        self._supervisor.join(timeout=30)  # before the workers go: it would replace them
        logger.info("stopping the workers")
        # Graceful shutdown where a worker answers; one that is dead or still pending does
        # not hold the exit up for more than the bound.
        refs = []
        for actors in self.actors.values():
            for a in actors:
                try:
                    refs.append(a.shutdown.remote())
                except Exception:  # already dead
                    pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=30)
        self._kill_actors()
        ray.shutdown()  # stops the embedded instance; only disconnects from a cluster
        logger.info("stopped")


#: Seconds a failed start waits for the kernel build it began (`_build_kernels_ahead`), so that
#: its compilers and their scratch folder do not outlive `serve`.
_KERNELS_JOIN_S = 30.0


def _build_kernels_ahead(config: ServeConfig) -> threading.Thread | None:
    """Begin building the CPU kernels in a thread of this process, where the workers will
    run them on this machine (embedded Ray, our engine, on the CPU): the build then runs
    while Ray starts and the workers load their models, and the first worker to need it
    waits for it under the build's file lock rather than starting it then. None elsewhere
    (a cluster's workers build on their own nodes)."""
    if config.address is not None or config.engine != "hybrid-pd":
        return None
    if config.device and not config.device.startswith("cpu"):
        return None
    from hybrid_pd.engine import cpu_kernels

    return cpu_kernels.build_ahead()


class Interrupted(Exception):
    """Asked to stop (`interrupt` set) before the deployment was up; nothing is left running."""


def _own_signal_handlers() -> dict[int, Callable]:
    """This process's Python handlers of SIGTERM and SIGINT (on the main thread only, where
    signals are handled; the defaults are left to Ray)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    out = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            out[sig] = handler
    return out


def wait_ready(url: str, timeout: float = 120.0, abort: threading.Event | None = None) -> None:
    """Block until the proxy's /health answers 200 (or, quietly, until `abort` is set)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if abort is not None and abort.is_set():
            return
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout:.0f} s")
