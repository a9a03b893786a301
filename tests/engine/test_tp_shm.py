"""The shared-memory collectives of a tensor-parallel group (`engine/tp/shm_collectives.py`),
between real rank processes joined through a real rendezvous store and gloo group:

- every all-reduce equals the rank-ordered float32 sum bit for bit (and gloo's path), for
  tensors smaller and larger than a slot; a column gather gives rank 0 every rank's bits;
  broadcasts of small, empty and larger-than-a-slot (gloo fallback) objects arrive whole;
- a rank that dies makes the ranks waiting for it raise within a bounded time (rank 0 dying
  under a follower's broadcast, a follower dying under rank 0's all-reduce);
- no /dev/shm name is left behind, whatever happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_pd.engine.tp.group import open_rendezvous
from hybrid_pd.engine.tp.native import library
from hybrid_pd.engine.tp.shm_collectives import SHM_DIR

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(library() is None, reason="no C compiler or not Linux"),
]


def _segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("hybrid-pd-tp-*")}


def _run_group(size: int, mode: str, *extra: str, timeout_s: float = 180.0) -> list[dict]:
    """Every rank's JSON line (rank order); ranks that printed nothing are left out."""
    store, address = open_rendezvous(size, timeout_s=60.0)
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HYBRID_PD_TP_SHM_SLOT_BYTES": str(64 << 10),  # the larger inputs take several chunks
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.engine.shm_peer",
                "--rank",
                str(r),
                "--size",
                str(size),
                "--rendezvous",
                address,
                "--mode",
                mode,
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for r in range(size)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if lines:
                results.append(json.loads(lines[-1]))
            elif proc.returncode != 3:
                raise AssertionError(f"a rank failed ({proc.returncode}): {err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        del store
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_broadcasts_are_exact(size):
    before = _segments()
    results = _run_group(size, "exact", "--rounds", "3")
    assert [r["rank"] for r in results] == list(range(size))
    for r in results:
        assert r["shm"], "the group fell back to gloo"
        assert r["bad"] == []
        assert r["calls"] == 3 * (4 * 3 + 3 + 3)
    assert _segments() <= before


@pytest.mark.parametrize("victim", [1, 0])
def test_dead_peer_is_an_error_not_a_hang(victim):
    before = _segments()
    results = _run_group(2, "die-after-one", "--victim", str(victim), timeout_s=60.0)
    assert len(results) == 1, results
    survivor = results[0]
    assert survivor["shm"]
    assert survivor["error"] is not None and f"rank {victim}" in survivor["error"]
    assert survivor["waited_s"] < 5.0
    assert _segments() <= before
