"""The scenarios of `hybrid-pd bench load`, each on a fresh `serve` of each mode:

- `mixed`: the mix at each concurrency level; a few requests are sent again once the load is
  over and their text compared (`verify`).
- `kill_prefill` / `kill_decode`: the same mix; once a third of the requests have ended, the
  prefill (decode) worker process gets SIGKILL. The pid is the descendant of our `serve`
  process that listens on the worker's gRPC port (from the proxy's /health).
- `small_kv`: workers with a tiny KV pool, long streaming prompts: requests must queue.

After each one, the pool gets a while to become idle and its blocks are counted (leaks)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from hybrid_pd.bench.load.mix import (
    LoadRequest,
    Outcome,
    compare_texts,
    make_mix,
    make_request,
    run_requests,
    send,
    summarize,
    texts,
)
from hybrid_pd.bench.load.options import WORKERS, LoadOptions
from hybrid_pd.bench.load.procs import Serve
from hybrid_pd.bench.load.state import settle, worker_with_role
from hybrid_pd.bench.service import _routes

#: A wait of this fraction of a limit counts as "near a timeout".
NEAR = 0.8
#: A scenario does not start with less time than this left.
MIN_SCENARIO_S = 20.0


@dataclass
class Context:
    opts: LoadOptions
    deadline: float
    log_dir: Path
    #: mode -> request index -> text, from the mixed scenario's first level.
    texts: dict[str, dict[int, str]] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def load(
        self, url: str, reqs: list[LoadRequest], concurrency: int, desc: str
    ) -> tuple[list[Outcome], float]:
        """One measured load, with a progress bar when wanted."""
        o = self.opts
        return asyncio.run(
            run_requests(
                url,
                reqs,
                concurrency,
                o.request_timeout_s,
                self.deadline,
                desc=desc,
                progress=o.progress,
            )
        )


def _warm_up(ctx: Context, url: str) -> int:
    """Two requests (not measured): a fresh worker's first forward passes are slow."""
    reqs = make_mix(ctx.opts.model, f"{ctx.opts.seed}-warmup", 2)
    timeout = min(ctx.opts.request_timeout_s, 120.0)
    outs, _ = asyncio.run(run_requests(url, reqs, 1, timeout, ctx.deadline))
    return sum(1 for o in outs if not o.ok)


def _on_fresh_serve(
    ctx: Context, mode: str, kv_memory: str, body: Callable[[Serve], dict[str, Any]]
) -> dict[str, Any]:
    """`body` on a fresh, warmed-up `serve` of `mode`; then the proxy's routes and the settled
    pool go into the result, and the service is stopped."""
    p, d = WORKERS[mode]
    timeout = max(5.0, min(300.0, ctx.left()))
    serve = Serve(ctx.opts.model, ctx.opts.threads, p, d, kv_memory, ctx.log_dir, timeout)
    try:
        result: dict[str, Any] = {"serve": serve.info(), "warmup_failed": _warm_up(ctx, serve.url)}
        result.update(body(serve))
        try:
            result["routes"] = _routes(serve.url)
        except Exception as e:
            result["routes"] = {"error": f"{type(e).__name__}: {e}"}
        wait = max(0.0, min(ctx.opts.settle_s, ctx.left()))
        result.update(settle(serve.url, serve.secret, {"prefill": p, "decode": d}, wait))
        return result
    finally:
        serve.stop()


def scenario_mixed(ctx: Context, mode: str) -> dict:
    o = ctx.opts

    def body(serve: Serve) -> dict[str, Any]:
        levels = []
        first: list[LoadRequest] = []
        under_load: dict[int, str] = {}
        for k, c in enumerate(o.concurrency):
            reqs = make_mix(o.model, f"{o.seed}-mix{k}", o.requests)
            outs, wall = ctx.load(serve.url, reqs, c, f"{mode} mixed c={c}")
            levels.append({"concurrency": c, **summarize(len(reqs), outs, wall)})
            if k == 0:
                first, under_load = reqs, texts(outs)
        ctx.texts[mode] = under_load
        # Greedy requests sent again on the idle pool: the same text as under load.
        picks = sorted({round(j * len(first) / o.verify) for j in range(o.verify)})
        again, _ = asyncio.run(
            run_requests(serve.url, [first[i] for i in picks], 1, o.request_timeout_s, ctx.deadline)
        )
        replay = texts(again)
        verify = {
            "indexes": picks,
            **compare_texts(under_load, replay),
            "unchecked": len(picks) - len(set(under_load) & set(replay)),
        }
        return {"levels": levels, "verify": verify}

    return _on_fresh_serve(ctx, mode, o.kv_memory, body)


def scenario_kill(ctx: Context, mode: str, role: str) -> dict:
    o = ctx.opts
    if role == "prefill" and WORKERS[mode][0] == 0:
        return {"skipped": f"no prefill worker in {mode} mode"}

    def body(serve: Serve) -> dict[str, Any]:
        import httpx

        target = worker_with_role(serve.url, role)
        port = int(target["address"].rsplit(":", 1)[1]) if target else None
        pid = serve.worker_pid(port) if port else None
        kill: dict[str, Any] = {"role": role, "pid": pid, "address": target and target["address"]}
        if pid is None:
            kill["error"] = f"no {role} worker process found among serve's descendants"
        reqs = make_mix(o.model, f"{o.seed}-mix0", o.kill_requests)
        trigger = max(1, len(reqs) // 3)
        # When the kill happened, the worker came back, the watch stops, a probe completed.
        state: dict[str, Any] = {"t": None, "back": None, "stop": None, "probe_ok": None}

        def on_result(out: Outcome, outs: list[Outcome]) -> None:
            if pid is None or state["t"] is not None or len(outs) < trigger:
                return
            state["t"] = time.monotonic()
            kill["killed"] = serve.kill_worker(pid)
            kill["after_requests"] = len(outs)

        async def watch() -> None:
            """Until a worker of the role is healthy again at a new address (Ray restarts it)."""
            async with httpx.AsyncClient(base_url=serve.url, trust_env=False) as client:
                while time.monotonic() < min(ctx.deadline, state["stop"] or float("inf")):
                    await asyncio.sleep(1.0)
                    if state["t"] is None:
                        if state["stop"] is not None:
                            return  # the load ended without a kill
                        continue
                    try:
                        workers = (await client.get("/health", timeout=10)).json()["workers"]
                    except Exception:
                        continue
                    if any(
                        role in w["roles"] and w["healthy"] and w["address"] != kill["address"]
                        for w in workers
                    ):
                        state["back"] = time.monotonic() - state["t"]
                        return

        async def probe(t: float) -> None:
            """The load ended before the service recovered: one request at a time (not
            counted in the load) until one completes, for at most a minute."""
            req = make_request(o.model, f"{o.seed}-probe", 0)
            end = min(ctx.deadline, time.monotonic() + 60)
            async with httpx.AsyncClient(base_url=serve.url, trust_env=False) as client:
                while time.monotonic() < end:
                    out = await send(client, req, min(o.request_timeout_s, 60.0), end)
                    if out.ok and out.start > t:
                        state["probe_ok"] = out.end
                        return
                    await asyncio.sleep(0.5)

        async def load() -> tuple[list[Outcome], float]:
            watcher = asyncio.create_task(watch())
            try:
                res = await run_requests(
                    serve.url,
                    reqs,
                    o.kill_concurrency,
                    o.request_timeout_s,
                    ctx.deadline,
                    on_result=on_result,
                    desc=f"{mode} kill {role}",
                    progress=o.progress,
                )
            finally:
                state["stop"] = time.monotonic() + 60
            t = state["t"]
            if t is not None and not any(x.ok and x.start > t for x in res[0]):
                await probe(t)
            await watcher
            return res

        outs, wall = asyncio.run(load())
        result = {**summarize(len(reqs), outs, wall), "concurrency": o.kill_concurrency}
        recovery = recovered_by = back = None
        if (t := state["t"]) is not None:
            kill["failed_after_kill"] = sum(1 for x in outs if not x.ok and x.end > t)
            recovered = [x.end for x in outs if x.ok and x.start > t]
            if recovered:
                recovery, recovered_by = round(min(recovered) - t, 3), "load"
            elif state["probe_ok"]:
                recovery, recovered_by = round(state["probe_ok"] - t, 3), "probe"
            back = round(state["back"], 3) if state["back"] else None
        result.update(recovery_s=recovery, recovered_by=recovered_by, worker_back_s=back)
        result["kill"] = kill
        result["vs_mixed"] = compare_texts(ctx.texts.get(mode, {}), texts(outs))
        return result

    return _on_fresh_serve(ctx, mode, o.kv_memory, body)


def scenario_small_kv(ctx: Context, mode: str) -> dict:
    from hybrid_pd.proxy.config import ProxyConfig

    o = ctx.opts

    def body(serve: Serve) -> dict[str, Any]:
        c = o.small_kv_prompt_chars
        chars = (max(10, c - c // 20), c + c // 20)
        reqs = make_mix(o.model, f"{o.seed}-smallkv", o.small_kv_requests, chars=chars, stream=True)
        outs, wall = ctx.load(serve.url, reqs, o.small_kv_concurrency, f"{mode} small_kv")
        result = {**summarize(len(reqs), outs, wall), "concurrency": o.small_kv_concurrency}
        # The limits a queued request runs into: the proxy's wait for a first token (prefill
        # deadline, or stream silence), and the whole request's deadline (proxy or client).
        proxy = ProxyConfig()
        first_limit = min(proxy.prefill_timeout_s, proxy.stream_idle_timeout_s)
        total_limit = min(proxy.request_timeout_s, o.request_timeout_s)
        near = [
            x
            for x in outs
            if x.kind == "timeout"
            or (x.ttft is not None and x.ttft >= NEAR * first_limit)
            or (x.ok and x.end - x.start >= NEAR * total_limit)
        ]
        e2e = [x.end - x.start for x in outs if x.ok]
        ttft = [x.ttft for x in outs if x.ttft is not None]
        result.update(
            all_finished=result["completed"] == len(reqs),
            max_e2e_s=round(max(e2e), 3) if e2e else None,
            max_ttft_s=round(max(ttft), 3) if ttft else None,
            near_timeout=len(near),
            timeout_limits_s={"first_token": first_limit, "request": total_limit},
        )
        return result

    return _on_fresh_serve(ctx, mode, o.small_kv_memory, body)


SCENARIO_RUNS: dict[str, Callable[[Context, str], dict]] = {
    "mixed": scenario_mixed,
    "kill_prefill": partial(scenario_kill, role="prefill"),
    "kill_decode": partial(scenario_kill, role="decode"),
    "small_kv": scenario_small_kv,
}


def run_bench(opts: LoadOptions, log_dir: Path | None = None) -> dict[str, Any]:
    """Every (mode, scenario), each on a fresh `serve`; stops by itself at the time limit.
    The serve logs are kept (and named in the result) when a scenario failed."""
    t0 = time.monotonic()
    made = log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="hybrid-pd-bench-load-")) if made else log_dir
    ctx = Context(opts, t0 + opts.time_limit_s, log_dir)
    out: dict[str, Any] = {}
    for mode in opts.modes:
        out[mode] = {}
        for name in opts.scenarios:
            if ctx.left() < MIN_SCENARIO_S:
                out[mode][name] = {"skipped": "time limit reached"}
                continue
            try:
                out[mode][name] = SCENARIO_RUNS[name](ctx, mode)
            except Exception as e:  # serve did not start, the proxy went away, ...
                out[mode][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if made and not any("error" in s for m in opts.modes for s in out[m].values()):
        shutil.rmtree(log_dir, ignore_errors=True)
    out["meta"] = {
        "settings": asdict(opts),
        "elapsed_s": round(time.monotonic() - t0, 2),
        "time_limit_hit": _time_limit_hit(out, opts.modes),
        "cross_mode": compare_texts(*ctx.texts.values()) if len(ctx.texts) == 2 else None,
        "serve_logs": None if made and not log_dir.exists() else str(log_dir),
    }
    return out


def _time_limit_hit(out: dict[str, Any], modes: tuple[str, ...]) -> bool:
    """Whether the time limit cut anything: a skipped scenario, an unsent or cut request."""
    for mode in modes:
        for r in out[mode].values():
            if r.get("skipped") == "time limit reached":
                return True
            for row in r.get("levels") or [r]:
                if row.get("not_sent") or "time_limit" in row.get("failed_by_kind", {}):
                    return True
    return False
