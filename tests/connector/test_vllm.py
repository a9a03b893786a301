"""hybrid-pd's connector inside real vLLM servers.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own
(docs/vllm.md; `.ci/run` builds it). This test runs that environment's pytest on
tests/vllm_connector and requires every test there to run and pass. Without the
environment it is skipped, unless HYBRID_PD_REQUIRE_VLLM=1 (as in CI)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("HYBRID_PD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _has_vllm() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, hybrid_pd"], capture_output=True, timeout=300
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_vllm_servers_with_hybrid_pd_connector():
    if not _has_vllm():
        if os.environ.get("HYBRID_PD_REQUIRE_VLLM") == "1":
            pytest.fail(f"HYBRID_PD_REQUIRE_VLLM=1 but {VLLM_PYTHON} cannot import vllm")
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (see docs/vllm.md)")
    out = subprocess.run(
        [str(VLLM_PYTHON), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/vllm_connector"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )  # fmt: skip
    log = out.stdout + out.stderr
    tail = log[-6000:]
    assert out.returncode == 0, tail
    summary = log.strip().splitlines()[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    assert counts.get("passed", 0) >= 20, tail
    assert not counts.get("skipped") and not counts.get("failed"), tail
