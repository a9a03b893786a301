"""Waiting lives in the scheduler: nothing on the connector's request path sleeps or polls.

The scan covers the connector's own modules (connector/*.py). Left out: `ucx/` and `vllm/`
(the data plane's poller thread and vLLM's process, not a request's wait) and `faults.py`,
whose one sleep is the test-only "slow_prefill" fault that slows the prefill engine's step
and is inert unless HYBRID_PD_INJECT_FAULT is set.
"""

from __future__ import annotations

import ast
import asyncio
import threading
import time
from pathlib import Path

from hybrid_pd.connector import control
from hybrid_pd.connector.control import KVControlServicer
from hybrid_pd.proto import kv_control_pb2 as pb
from tests.connector.test_connector_units import _late_keeper, _staged_keeper

CONNECTOR = Path(control.__file__).parent
NOT_SCANNED = {"faults.py"}
#: Calls that hold a thread or poll per request: sleeps, and the Condition an early pull
#: once waited on.
BANNED_ATTRS = {("time", "sleep"), ("asyncio", "sleep"), ("threading", "Condition")}
BANNED_NAMES = {("time", "sleep"), ("asyncio", "sleep"), ("threading", "Condition")}


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio", "threading"):
            for alias in node.names:
                if (node.module, alias.name) in BANNED_NAMES:
                    found.append(
                        f"{path.name}:{node.lineno} from {node.module} import {alias.name}"
                    )
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in BANNED_ATTRS:
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_sleep_or_poll_on_the_connectors_request_path():
    files = sorted(p for p in CONNECTOR.glob("*.py") if p.name not in NOT_SCANNED)
    assert {"decode.py", "decode_stage.py", "prefill.py", "control.py"} <= {p.name for p in files}
    offences = [o for p in files for o in _offences(p)]
    assert not offences, f"waiting outside the scheduler: {offences}"


def test_the_scan_sees_a_sleep(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom asyncio import sleep\ndef f():\n    time.sleep(0.05)\n")
    assert len(_offences(bad)) == 2


class _Context:
    async def abort(self, code, details):  # pragma: no cover - a prefill connector is given
        raise AssertionError(details)

    def time_remaining(self):
        return 30.0


def test_progress_is_answered_when_the_engine_publishes_not_by_a_poll():
    """A Progress call waits on the request's events: the engine's `stage_progress` from
    another thread answers it at once, and no watcher is left behind."""
    conn, _, kinds, full = _staged_keeper()
    servicer = KVControlServicer("p", conn.layout, b"ucx", conn)
    conn.stage_begin("r", "tok")
    blocks = [[] for _ in kinds]
    blocks[full] = [5, 6]

    def publish():
        time.sleep(0.3)  # the test's own engine step
        conn.stage_progress("r", 8, blocks)

    ask = pb.ProgressRequest(request_id="r", transfer_token="tok", min_tokens=8, wait_s=5.0)
    engine = threading.Thread(target=publish)
    t0 = time.monotonic()
    engine.start()
    reply = asyncio.run(servicer.Progress(ask, _Context()))
    took = time.monotonic() - t0
    engine.join()
    assert reply.ok and reply.state == "running" and reply.computed_tokens == 8
    assert 0.25 < took < 2.0
    assert len(conn.watchers) == 0
    # Past its wait with nothing published, it answers with where the request is.
    ask = pb.ProgressRequest(request_id="r", transfer_token="tok", min_tokens=99, wait_s=0.2)
    t0 = time.monotonic()
    reply = asyncio.run(servicer.Progress(ask, _Context()))
    assert reply.ok and reply.state == "running" and 0.15 < time.monotonic() - t0 < 2.0
    bad = pb.ProgressRequest(request_id="r", transfer_token="guess", min_tokens=1, wait_s=1.0)
    assert not asyncio.run(servicer.Progress(bad, _Context())).ok


def test_an_early_pull_awaits_its_keep_on_the_loop():
    """A PullKV that comes before its request's keep (vLLM's order) awaits the keep on the
    event loop, then sends; a pull for a request never kept fails after the wait."""
    conn, _ = _late_keeper(keep_wait_s=5.0)
    servicer = KVControlServicer("p", conn.layout, b"ucx", conn)
    keeper = threading.Timer(0.3, conn.keep, args=("r", "tok", ((1, 2), ())))
    pull = pb.PullRequest(
        request_id="r",
        transfer_token="tok",
        ucx_address=b"peer",
        tag=64,
        dst_blocks=[pb.BlockIds(ids=[5, 6]), pb.BlockIds(ids=[])],
    )
    t0 = time.monotonic()
    keeper.start()
    reply = asyncio.run(servicer.PullKV(pull, _Context()))
    keeper.join()
    assert reply.ok and reply.messages == 1 and 0.25 < time.monotonic() - t0 < 4.0
    assert conn.transport.sent[0][2] == [(1, 2)] and len(conn.watchers) == 0
    conn.keep_wait_s = 0.3
    never = pb.PullRequest(request_id="nobody", transfer_token="tok", dst_blocks=[])
    t0 = time.monotonic()
    reply = asyncio.run(servicer.PullKV(never, _Context()))
    assert not reply.ok and "no KV kept" in reply.error
    assert 0.25 < time.monotonic() - t0 < 3.0
