"""Tensor-parallel settings of `serve` and `generate`: what reaches the workers, and what
is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybrid_pd.launcher.serve_config import ServeConfig


def test_per_role_sizes_reach_the_worker_configs():
    config = ServeConfig(tensor_parallel_size=2, decode_tensor_parallel_size=1, threads=1)
    assert config.tp_size("prefill") == 2 and config.tp_size("decode") == 1
    assert config.worker_config("prefill", "m").tensor_parallel_size == 2
    assert config.worker_config("decode", "m").tensor_parallel_size == 1
    assert config.worker_config("prefill", "m").rank_threads == 1
    # the embedded host's engine processes: every rank of every worker
    assert ServeConfig(prefill=2, decode=1, tensor_parallel_size=2).engine_processes == 6


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor-parallel size must be >= 1"),
        (
            {"decode_tensor_parallel_size": 3, "overlap_transfer": True},
            r"overlap_transfer is verified with tensor-parallel sizes 1, 2 and 4 only \(prefill "
            r"1, decode 3\)",
        ),
        ({"tensor_parallel_size": 8, "overlap_transfer": True}, "prefill 8, decode 8"),
    ],
)
def test_unverified_or_bad_sizes_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**settings)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 2), (4, 2), (1, 4)])
def test_overlap_with_verified_tp_sizes_is_taken(p_tp, d_tp):
    config = ServeConfig(
        overlap_transfer=True, prefill_tensor_parallel_size=p_tp, decode_tensor_parallel_size=d_tp
    )
    assert config.overlap_transfer and (config.tp_size("prefill"), config.tp_size("decode")) == (
        p_tp,
        d_tp,
    )


def test_engine_vllm_takes_per_role_sizes():
    config = ServeConfig(engine="vllm", model="/m", prefill_tensor_parallel_size=2)
    assert (config.tp_size("prefill"), config.tp_size("decode")) == (2, 1)
    assert config.engine_processes == 3


def test_cli_refuses_per_role_sizes_without_disaggregation():
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_pd.launcher.cli", "generate", "--prompt-ids", "1,2",
         "--prefill-tensor-parallel-size", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "need --disaggregated" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "hybrid_pd.launcher.cli", "serve", "--tensor-parallel-size", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr
