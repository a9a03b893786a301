"""The proxy's access log: one line per HTTP request, on logger `hybrid_pd.access`, written
when the response has ended (for a stream: when the stream ends).

    POST /v1/completions status=200 id=cmpl-3f9c... route=disaggregated prompt_tokens=15
    output_tokens=12 ttft_ms=84.2 total_ms=411.9 prefill=127.0.0.1:50051
    decode=127.0.0.1:50052 client=127.0.0.1

`prefill` / `decode`: the workers that served it (the last of each after a retry or a
migration; several choices: each distinct one, comma-separated).

`AccessLog` is pure ASGI middleware (streams pass through untouched). A request that runs on
the workers gets its id, route and token counts from its dispatch `Job`, which `attach`
hands over through a context variable, so the endpoints need no code of their own.
A client that went away before the response ended is logged with status 499. Requests
without a job show `-` there. Probes and scrapes (`/health`, `/metrics`) are logged at
debug, everything else at info.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

logger = logging.getLogger("hybrid_pd.access")

#: Paths polled every few seconds by health checks and Prometheus: debug level only.
QUIET_PATHS = ("/health", "/metrics")
#: nginx's "client closed request": the client left before the response ended.
CLIENT_CLOSED = 499


@dataclass
class _Record:
    #: The dispatch Jobs serving the request (one per choice), once started.
    jobs: list = field(default_factory=list)


_current: ContextVar[_Record | None] = ContextVar("hybrid_pd_access_record", default=None)


def attach(job) -> None:
    """The request being served in this context runs `job` (a dispatch Job: its `rid`,
    `route`, `prompt_ids`, `produced`, `arrival`, `first_token_at`, `prefill_worker` and
    `decode_worker` are logged)."""
    record = _current.get()
    if record is not None:
        record.jobs.append(job)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def format_line(
    method: str, path: str, status: int, total_s: float, job=None, client: str = "-"
) -> str:
    """The access-log line of one request (see the module's docstring). `job` is a Job or
    the list of a request's Jobs (n choices: `<id>-<i>` each; output tokens summed)."""
    jobs = job if isinstance(job, list) else [job] if job is not None else []
    rid = route = prompt = output = ttft = prefill = decode = "-"
    if jobs:
        prefill = _workers(jobs, "prefill_worker")
        decode = _workers(jobs, "decode_worker")
        first = jobs[0]
        rid = first.rid.rpartition("-")[0] if len(jobs) > 1 else first.rid
        route = ",".join(sorted({j.route for j in jobs if j.route})) or "-"
        prompt, output = str(len(first.prompt_ids)), str(sum(len(j.produced) for j in jobs))
        starts = [j.first_token_at for j in jobs if j.first_token_at is not None]
        if starts:
            ttft = _ms(min(starts) - first.arrival)
    return (
        f"{method} {path} status={status} id={rid} route={route} prompt_tokens={prompt} "
        f"output_tokens={output} ttft_ms={ttft} total_ms={_ms(total_s)} prefill={prefill} "
        f"decode={decode} client={client}"
    )


def _workers(jobs: list, attr: str) -> str:
    names = dict.fromkeys(getattr(j, attr, "") for j in jobs)
    return ",".join(n for n in names if n) or "-"


class AccessLog:
    """Pure ASGI middleware: one access-log line per HTTP request once its response ends."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        record = _Record()
        token = _current.set(record)
        status: int | None = None
        ended = gone = False

        async def watching_receive():
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not ended:
                gone = True
            return message

        async def watching_send(message):
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            await self.app(scope, watching_receive, watching_send)
        finally:
            _current.reset(token)
            path = scope.get("path", "")
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            if logger.isEnabledFor(level):
                if gone:
                    status = CLIENT_CLOSED
                client = scope.get("client")
                line = format_line(
                    scope.get("method", "-"),
                    path,
                    500 if status is None else status,  # it raised before answering
                    time.monotonic() - start,
                    record.jobs,
                    client[0] if client else "-",
                )
                logger.log(level, "%s", line)
