"""Streaming completions against an OpenAI endpoint, as the serving benchmarks send them:
prompts of random token ids, one level of load at a fixed concurrency (`run_level`), the
per-request figures (TTFT, inter-token gaps, end to end) and their percentiles, and a progress
line on stderr."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor


def _pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


def _ms(values: list[float], q: float) -> float | None:
    x = _pct(values, q)
    return None if x is None else round(1000 * x, 2)


def _prompt(seed: str, n: int, vocab: int | None) -> list[int]:
    """Distinct random token ids per request (no prefix-cache hits). Small vocabularies
    (the byte-level tiny model) use ids 0-255; large ones skip the low ids, often special."""
    rng = random.Random(seed)
    lo, hi = (0, 256) if not vocab or vocab < 1024 else (1000, min(vocab, 32000))
    return [rng.randrange(lo, hi) for _ in range(n)]


class StreamError(Exception):
    """A completion stream that failed; its message is what a result's "error" holds."""


def completion_chunks(client, body: dict) -> Iterator[dict]:
    """The JSON chunks of one streaming ``/v1/completions`` call (httpx `client`), up to
    ``[DONE]``; StreamError for an answer other than 200 or an error chunk."""
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise StreamError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise StreamError(str(obj["error"])[:200])
            yield obj


def _one_request(client, body: dict) -> dict:
    """One streaming completion: TTFT, per-token gaps (from SSE chunk arrival), e2e."""
    t0 = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    ids: list[int] = []
    try:
        for obj in completion_chunks(client, body):
            got = [t for c in obj.get("choices") or () for t in c.get("token_ids") or ()]
            ids += got
            n = len(got)
            if n:
                times.append(time.perf_counter())
                counts.append(n)
    except StreamError as e:
        return {"error": str(e)}
    except Exception as e:  # a failed request is counted, not raised
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    if not times:
        return {"error": "no tokens"}
    # A chunk of n tokens after a gap g counts as n gaps of g / n.
    itl = [
        (times[k] - times[k - 1]) / counts[k]
        for k in range(1, len(times))
        for _ in range(counts[k])
    ]
    return {
        "ttft": times[0] - t0,
        "e2e": time.perf_counter() - t0,
        "tokens": sum(counts),
        "itl": itl,
        "token_ids": ids,
    }


class _Counter:
    """The one-line progress counter on stderr when tqdm is not installed."""

    def __init__(self, total: int, desc: str, disable: bool) -> None:
        self.total, self.desc, self.disable, self.n = total, desc, disable, -1
        self.update()

    def update(self, k: int = 1) -> None:
        self.n += k
        if not self.disable:
            print(f"\r{self.desc}: {self.n}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.disable:
            print(file=sys.stderr, flush=True)


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, desc, disable=not enabled)
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=not enabled)


def run_level(
    url: str,
    model_name: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    deadline: float,
    desc: str,
    progress: bool = True,
    keep_token_ids: bool = False,
    extra: dict | None = None,
) -> dict:
    """Send the prompts with at most `concurrency` in flight; none starts after `deadline`.
    `keep_token_ids`: the result's `token_ids` maps each completed prompt's index to the
    token ids streamed back. `extra`: more fields of every request's body (a constraint)."""
    import httpx

    results: list[dict] = []
    lock = threading.Lock()
    nxt = iter(range(len(prompts)))
    bar = _progress(len(prompts), desc, progress)
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency + 2)

    def loop(client) -> None:
        while time.monotonic() < deadline:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            body = {
                "model": model_name,
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
                **(extra or {}),
            }
            out = _one_request(client, body)
            out["index"] = i
            with lock:
                results.append(out)
                bar.update()

    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=timeout, limits=limits, trust_env=False) as client:
        with ThreadPoolExecutor(concurrency) as ex:
            for f in [ex.submit(loop, client) for _ in range(concurrency)]:
                f.result()
    wall = time.perf_counter() - t0
    bar.close()
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    series = {
        "ttft": [r["ttft"] for r in ok],
        "itl": [g for r in ok for g in r["itl"]],
        "e2e": [r["e2e"] for r in ok],
    }
    row = {
        "concurrency": concurrency,
        "launched": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r["error"] for r in results if "error" in r})[:3],
        "seconds": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2) if ok else None,
        "requests_per_s": round(len(ok) / wall, 3) if ok else None,
        **{f"{k}_ms_p{q}": _ms(v, q) for k, v in series.items() for q in (50, 90)},
    }
    if keep_token_ids:
        row["token_ids"] = {r["index"]: r["token_ids"] for r in ok}
    return row


#: Column headings of `run_level`'s row keys, in table order; a table takes those it shows.
LEVEL_COLUMNS = {
    "concurrency": "conc",
    "completed": "done",
    "errors": "err",
    "output_tokens_per_request": "tok/req",
    "output_tokens_per_s": "tok/s",
    "requests_per_s": "req/s",
    "ttft_ms_p50": "TTFT p50 ms",
    "ttft_ms_p90": "TTFT p90",
    "itl_ms_p50": "ITL p50",
    "itl_ms_p90": "ITL p90",
    "e2e_ms_p50": "e2e p50",
    "e2e_ms_p90": "e2e p90",
}


def level_columns(*skip: str) -> dict[str, str]:
    """`LEVEL_COLUMNS` less the keys in `skip`, for `print_rows`."""
    return {k: v for k, v in LEVEL_COLUMNS.items() if k not in skip}


def print_rows(title: str, cols: dict[str, str], rows: list[dict]) -> None:
    """A titled table of result rows: `cols` maps a row's key to its column heading ("-"
    where a row has no value)."""
    print(title)
    print(" ".join(f"{c:>11}" for c in cols.values()))
    for r in rows:
        print(" ".join(f"{'-' if r.get(c) is None else r[c]:>11}" for c in cols))
