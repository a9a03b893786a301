"""`hybrid-pd serve --engine vllm`: a vLLM worker process (a rank) of the prefill server
is SIGKILLed. vLLM stops that server; its worker actor ends with it (it would otherwise
stay up answering nothing) and is re-created whole with a fresh server; the old server's
process group is gone; requests sent while it was down are answered, and every answer
equals one vLLM instance's; after the re-creation prompts are disaggregated again. One
rank here; test_serve_tp.py runs the same with a TP-2 prefill (collected only with
HYBRID_PD_VLLM_TP=1). About two minutes on two cores, in a network namespace of its own."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.vllm_connector.serve_scenario import run_isolated

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("unshare") is None or os.geteuid() != 0,
        reason="needs root and unshare for a private network namespace",
    ),
]


def run_rank_death(tmp_path, prefill_tp: int) -> dict:
    """The scenario's JSON, checked: see the module's doc."""
    result = run_isolated(
        tmp_path, "tests.vllm_connector.serve_rank_death_scenario", f"--prefill-tp {prefill_tp}"
    )
    assert result["ranks"] == prefill_tp, result
    assert result["recreated"], f"the worker was not re-created: {result}"
    assert result["old_group_left"] == [], "the dead server's processes outlived it"
    assert not result["old_temp_dir_left"], "the dead server's temp folder was left"
    assert result["segments_before"] == (2 if prefill_tp == 2 else 0), result
    assert result["old_segments_left"] == [], "the dead server's shared memory was left"
    assert len({json.dumps(w) for w in result["want"][1:4]}) == 3, "weights too flat to tell"
    assert result["equal"], result
    assert result["routes_after"] == [3.0], "not disaggregated again after the re-creation"
    return result


def test_a_prefill_rank_killed_takes_its_worker_down_and_it_comes_back_whole(tmp_path):
    run_rank_death(tmp_path, prefill_tp=1)
