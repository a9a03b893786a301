"""The hand-off's figures for `hybrid-pd bench vllm`: per prompt length, p50 / p99 of

- `decode_ttft_s`: measured by the client for every connector alike, from sending the
  decode request (with the prefill's kv_transfer_params) to its first streamed token: the
  whole hand-off as a router sees it, decode's first step and the HTTP hops included;
- `handoff_s` (hybrid-pd only, from the servers' timeline stamps, `connector.timeline`):
  from the prefill scheduler handing out the params (its last step done) to the decode
  scheduler planning the request's first step after the load; the client's round trip
  between the two servers is inside it;
- `pull_s`: from the decode worker's pull thread starting to the bytes' arrival;
- `stages_ms_p50` / `stages_ms_max`: each stage's time (from the stage before it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from hybrid_pd.connector.timeline import parse

#: The stages of one hand-off in the order they happen (`connector.timeline`).
STAGES = (
    "params_out",
    "keep_meta",
    "kept",
    "decode_arrived",
    "load_planned",
    "load_applied",
    "pull_start",
    "peer_ready",
    "reads_posted",
    "reads_done",
    "recvs_posted",
    "pull_received",
    "keep_present",
    "sends_posted",
    "sends_done",
    "read_confirmed",
    "pull_replied",
    "bytes_arrived",
    "finish_load",
    "reported",
    "finished_seen",
    "first_step",
)


def timelines(logs: Iterable[Path]) -> dict[str, dict[str, float]]:
    """Every hand-off's stamps from the servers' logs (missing logs skipped)."""
    out: dict[str, dict[str, float]] = {}
    for log in logs:
        if not Path(log).exists():
            continue
        with open(log, errors="replace") as f:
            for rid, stamps in parse(f).items():
                out.setdefault(rid, {}).update(stamps)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` percentile (0 < q <= 100) of `values` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


#: Stages measured from a stage other than the one stamped before them: the decode server's
#: arrival follows the params leaving the prefill, while the prefill's keep runs beside the
#: client's hop and may be stamped after it.
SINCE = {"decode_arrived": "params_out"}


def stage_deltas(stamps: dict[str, float]) -> dict[str, float]:
    """Milliseconds of each stamped stage since the stage stamped before it, in `STAGES`'
    order, or since its cause where `SINCE` names one (the prefill's keep chain and the
    decode's arrival overlap)."""
    out: dict[str, float] = {}
    prev = None
    for stage in STAGES:
        t = stamps.get(stage)
        if t is None:
            continue
        since = stamps.get(SINCE.get(stage, ""), prev)
        if since is not None:
            out[stage] = round((t - since) * 1e3, 3)
        prev = t
    return out


def _span(stamps: dict[str, float], first: str, last: str) -> float | None:
    if first in stamps and last in stamps:
        return stamps[last] - stamps[first]
    return None


def _p(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "p50": round(percentile(values, 50), 4),
        "p99": round(percentile(values, 99), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def handoff_figures(rows: list[dict], stamps: dict[str, dict[str, float]]) -> dict:
    """Per prompt length (string keys), p50 / p99 of the figures above; adds each row's
    `handoff_s`, `pull_s` and `stages_ms` where the servers stamped it."""
    by_len: dict[int, list[dict]] = {}
    for r in rows:
        st = stamps.get(r.get("handoff_id", ""), {})
        if st:
            r["handoff_s"] = _span(st, "params_out", "first_step")
            r["pull_s"] = _span(st, "pull_start", "bytes_arrived")
            r["stages_ms"] = stage_deltas(st)
        by_len.setdefault(r["prompt_len"], []).append(r)
    out: dict[str, dict] = {}
    for n, rs in sorted(by_len.items()):
        fig: dict = {"decode_ttft_s": _p([r["decode_ttft_s"] for r in rs])}
        for key in ("handoff_s", "pull_s"):
            got = _p([r[key] for r in rs if r.get(key) is not None])
            if got is not None:
                fig[key] = got
        staged = [r["stages_ms"] for r in rs if r.get("stages_ms")]
        if staged:
            names = [s for s in STAGES if any(s in d for d in staged)]
            fig["stages_ms_p50"] = {
                s: round(percentile([d[s] for d in staged if s in d], 50), 3) for s in names
            }
            fig["stages_ms_max"] = {s: round(max(d[s] for d in staged if s in d), 3) for s in names}
        out[str(n)] = fig
    return out
