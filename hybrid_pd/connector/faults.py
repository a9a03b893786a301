"""Fault injection for the tests only, read from HYBRID_PD_INJECT_FAULT; never set in
production, inert when unset.

"exit_during_pull": the prefill process exits after sending part of a transfer.
"zero_sends": zeros arrive in place of the KV (the proof that decode's output depends on
what it pulls): a prefill process sends zeros (two-sided pulls), a decode process writes
zeros over what it read (one-sided pulls); "zero_sends:MARK" only for the requests whose id
(the prefill's) contains MARK.
"slow_prefill:SECONDS": each step of a staged request takes that much longer on the prefill
engine's thread (so a test's decode worker sees its prefill in progress). This slows the
engine, not a request's wait: it is the one sleep the connector package holds, and the test
that keeps sleeps out of the request path knows this module by name.
"""

from __future__ import annotations

import logging
import os
import time

from hybrid_pd.kvcache.ids import RequestId

logger = logging.getLogger(__name__)

FAULT, _, FAULT_MARK = os.environ.get("HYBRID_PD_INJECT_FAULT", "").partition(":")


def slow_step() -> None:
    """Under "slow_prefill:SECONDS", hold the engine thread that long (else nothing)."""
    if FAULT == "slow_prefill":
        time.sleep(float(FAULT_MARK))


def zeroed(request_id: RequestId) -> bool:
    """Under "zero_sends[:MARK]": whether this request's sends are zeros."""
    return FAULT == "zero_sends" and FAULT_MARK in request_id


def die_mid_transfer(transport, peer: bytes, tag: int, regions: list) -> None:
    """Under "exit_during_pull": send half of the first region, then exit the process."""
    first = regions[0]
    half = first[: max(1, first.shape[0] // 2)]
    transport.send(peer, tag, [half], 10.0)
    logger.error("fault injection: exiting in the middle of a KV transfer")
    os._exit(17)
