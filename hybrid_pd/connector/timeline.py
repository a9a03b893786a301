"""The hand-off's timeline: wall-clock stamps of each stage of one request's hand-off,
written as debug log lines, for finding where a hand-off's time goes.

Every process of a P/D pair (the prefill engine's scheduler and worker, the decode engine's
scheduler and worker, their control and pull threads) stamps the stages it sees, keyed by
the prefill's request id (the id in kv_transfer_params, the same on both sides):

    prefill  params_out ─ keep_meta ─ kept ··· pull_received ─ keep_present ─ sends_posted
             ─ sends_done
    decode   load_planned ─ load_applied ─ pull_start ─ handshake ─ recvs_posted ─ pull_sent
             ─ pull_replied ─ bytes_arrived ─ finish_load ─ reported
             ─ finished_seen ─ first_step

A one-sided pull (`onesided`) has decode stamp reads_posted ─ reads_done in place of
recvs_posted, and the prefill read_confirmed in place of its pull_received .. sends_done.

One line per stamp, `timeline <id> <stage> <unix seconds> [key=value ...]`, at DEBUG on the
logger `hybrid_pd.connector.timeline`. Off by default (one `isEnabledFor` per stamp);
`HYBRID_PD_TIMELINE=1` in a process's environment turns it on there, with a stderr handler
(a vLLM server's log). Stamps of one machine's processes share the wall clock, so lines from
both servers' logs merge into one timeline (`parse`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

__all__ = ["ENV", "enabled", "parse", "stamp"]

ENV = "HYBRID_PD_TIMELINE"
logger = logging.getLogger(__name__)
_PREFIX = "timeline "

if os.environ.get(ENV, "") not in ("", "0"):
    logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(_handler)
        logger.propagate = False


def enabled() -> bool:
    """Whether stamps are written in this process."""
    return logger.isEnabledFor(logging.DEBUG)


def stamp(request_id: str, stage: str, **fields: object) -> None:
    """Note that `request_id`'s hand-off reached `stage` now (`fields`: a few numbers)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    extra = "".join(f" {k}={v}" for k, v in fields.items())
    logger.debug("%s%s %s %.6f%s", _PREFIX, request_id, stage, time.time(), extra)


def parse(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    """{request id: {stage: unix seconds}} from log lines (other lines skipped; a stage
    stamped twice keeps its first time)."""
    out: dict[str, dict[str, float]] = {}
    for line in lines:
        at = line.find(_PREFIX)
        if at < 0:
            continue
        parts = line[at + len(_PREFIX) :].split()
        if len(parts) < 3:
            continue
        try:
            t = float(parts[2])
        except ValueError:
            continue
        out.setdefault(parts[0], {}).setdefault(parts[1], t)
    return out
