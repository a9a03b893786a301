"""Serve the proxy with uvicorn: `run_proxy` (blocking, for the launcher) and `ProxyHandle`
(a background thread, for tests and embedding; port 0 picks a free port)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import uvicorn

from hybrid_pd.proxy.app import build_app
from hybrid_pd.proxy.config import ProxyConfig
from hybrid_pd.proxy.routing import WorkerPool

#: How long SIGTERM / SIGINT waits for requests in flight before closing their connections.
DRAIN_S = 30


def _uvicorn_config(
    config: ProxyConfig, pool: WorkerPool, port: int, drain_s: float = 5
) -> uvicorn.Config:
    return uvicorn.Config(
        build_app(config, pool),
        host=config.host,
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=drain_s,
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM / SIGINT that stopped it gracefully is not
    raised again afterwards: the process then exits normally (status 0), not by the signal."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_proxy(config: ProxyConfig, pool: WorkerPool | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then stop taking connections and let requests in flight
    finish (up to DRAIN_S). Builds the pool from the config if none."""
    own = pool is None
    pool = pool or WorkerPool.from_config(config)
    try:
        _DrainingServer(_uvicorn_config(config, pool, config.port, DRAIN_S)).run()
    finally:
        if own:
            pool.close()


class ProxyHandle:
    """`with ProxyHandle(config, pool, port=0) as proxy: ... proxy.base_url ...`"""

    def __init__(
        self,
        config: ProxyConfig,
        pool: WorkerPool | None = None,
        port: int | None = None,
        drain_s: float = 5.0,
    ) -> None:
        self.config = config
        self._own_pool = pool is None
        self.pool = pool or WorkerPool.from_config(config)
        #: How long `stop` lets requests in flight finish before closing their connections.
        self.drain_s = drain_s
        self._server = uvicorn.Server(
            _uvicorn_config(config, self.pool, config.port if port is None else port, drain_s)
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.port: int | None = None

    @property
    def app(self):
        return self._server.config.app

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 30.0) -> ProxyHandle:
        def serve() -> None:
            try:
                self._server.run()
            except BaseException as e:  # reported by start()
                self._error = e

        self._thread = threading.Thread(target=serve, name="proxy-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the proxy did not start: {self._error or 'timed out'}")
            time.sleep(0.01)
        sock = self._server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop taking connections, let requests in flight finish (up to `drain_s`), stop.
        Waits `timeout` (default: `drain_s` + 5 s) before forcing it."""
        timeout = self.drain_s + 5.0 if timeout is None else timeout
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout)
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> ProxyHandle:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
