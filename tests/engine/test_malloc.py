"""The glibc malloc settings engine processes apply (hybrid_pd/engine/malloc.py). Each
case runs in a fresh interpreter: the settings are process-wide and applied once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybrid_pd.engine import malloc

PROBE = (
    "import json, logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from hybrid_pd.engine.malloc import tune_malloc\n"
    "first = tune_malloc(); again = tune_malloc()\n"
    "print(json.dumps([first, again is first]))\n"
)


def _probe(**env: str) -> tuple[dict, bool, str]:
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "HYBRID_PD_MALLOC")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**full, **env}, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    settings, same = json.loads(out.stdout.strip().splitlines()[-1])
    return settings, same, out.stderr


@pytest.mark.skipif(malloc._glibc() is None, reason="not glibc")
def test_glibc_gets_the_settings_once_and_says_so():
    settings, same, log = _probe()
    assert settings == {name: value for name, (_, value) in malloc.SETTINGS.items()}
    assert same  # a second call changes nothing and returns the first result
    assert "malloc: mmap_threshold=1073741824" in log


def test_opt_out_and_preloaded_allocators_are_left_alone():
    settings, _, log = _probe(HYBRID_PD_MALLOC="default")
    assert settings == {} and "HYBRID_PD_MALLOC=default" in log
    # The name is enough to tell; the library need not exist for this check.
    settings, _, log = _probe(LD_PRELOAD="libtcmalloc_minimal.so.4")
    assert settings == {} and "preloaded allocator" in log
