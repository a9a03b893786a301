"""What `serve` does before it starts anything: its flags for logging, and a port already in
use refused at once (status 2, one line), before Ray starts or torch is imported."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time

import pytest

from hybrid_pd.launcher import cli
from hybrid_pd.launcher.console import PortUnavailable, check_port
from hybrid_pd.launcher.serve_config import ServeConfig

# Runs the CLI as `hybrid-pd` does, then says whether Ray or torch were ever imported.
CLI = """import sys
from hybrid_pd.launcher.cli import main
rc = main(sys.argv[1:])
print(sorted(m for m in ("ray", "torch") if m in sys.modules))
sys.exit(rc)
"""


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(autouse=True)
def _ray_console(monkeypatch):
    """cli.main sets Ray's console variables (the root logger is restored by conftest)."""
    for name in ("RAY_DEDUP_LOGS", "RAY_COLOR_PREFIX"):
        monkeypatch.delenv(name, raising=False)


def test_check_port(busy_port):
    with pytest.raises(PortUnavailable) as e:
        check_port("127.0.0.1", busy_port)
    assert str(e.value).startswith(f"port {busy_port} on 127.0.0.1 is in use (")
    check_port("127.0.0.1", 0)  # any free port: nothing to check
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_port("127.0.0.1", free)


def test_serve_on_a_busy_port_exits_2_at_once_without_starting_ray(busy_port):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "serve", "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"hybrid-pd serve: error: port {busy_port} on 127.0.0.1 is in use "
        "(another process listens there; choose another with --port)"
    ]
    assert proc.stdout.strip() == "[]"  # neither Ray nor torch was imported
    # Python's start and the CLI's imports only (it took 12-20 s, after Ray, before);
    # well under a second on an idle machine, the bound leaves room for a busy one.
    assert elapsed < 5, elapsed


class Started(Exception):
    pass


def _deployed_config(monkeypatch, argv: list[str]) -> ServeConfig:
    """The ServeConfig `hybrid-pd ARGV` hands to the Deployment (which is not started)."""
    import hybrid_pd.launcher.serve as serve

    seen = []

    def deployment(config, **_):
        seen.append(config)
        raise Started

    monkeypatch.setattr(serve, "Deployment", deployment)
    monkeypatch.setattr("signal.signal", lambda *_: None)
    with pytest.raises(Started):
        cli.main(argv)
    return seen[0]


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["serve"], "info"),
        (["serve", "-v"], "debug"),
        (["-v", "serve"], "debug"),
        (["serve", "--log-level", "warning"], "warning"),
        (["-v", "serve", "--log-level", "error"], "error"),  # the explicit level wins
    ],
)
def test_log_level_flags_reach_the_deployment(monkeypatch, argv, level):
    assert _deployed_config(monkeypatch, [*argv, "--port", "0"]).log_level == level
    assert logging.getLogger().level == getattr(logging, level.upper())


def test_log_level_setting_is_checked(tmp_path):
    with pytest.raises(ValueError, match="log level must be one of debug, info"):
        ServeConfig(log_level="loud")
    path = tmp_path / "serve.yaml"
    path.write_text("log_level: warning\n")
    assert ServeConfig.from_yaml(path).log_level == "warning"
    assert ServeConfig.from_yaml(path, log_level="debug").log_level == "debug"


def test_held_state_rows_reach_every_worker_engine(monkeypatch, tmp_path):
    """--held-state-rows (serve flag or YAML) becomes each worker's
    EngineConfig.held_state_rows_bytes; a bad size or engine vllm is refused before anything
    starts."""
    config = _deployed_config(monkeypatch, ["serve", "--port", "0", "--held-state-rows", "64MiB"])
    engine = config.worker_config("decode", "tiny").engine
    assert engine.held_state_rows_bytes == 64 * 2**20
    assert ServeConfig().worker_config("decode", "tiny").engine.held_state_rows_bytes is None
    path = tmp_path / "serve.yaml"
    path.write_text("held_state_rows: 0\n")
    off = ServeConfig.from_yaml(path).worker_config("prefill", "tiny").engine
    assert off.held_state_rows_bytes == 0
    with pytest.raises(ValueError, match="held_state_rows: cannot read 'lots'"):
        ServeConfig(held_state_rows="lots")
    with pytest.raises(ValueError, match="held_state_rows must be a size"):
        ServeConfig(held_state_rows=True)
    with pytest.raises(ValueError, match="engine hybrid-pd only"):
        ServeConfig(engine="vllm", model="some/folder", held_state_rows="1GiB")
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--held-state-rows", "12x"])
    assert e.value.code == 2


def test_worker_and_generate_read_held_state_rows():
    from hybrid_pd.workers.main import parse_args

    assert parse_args(["--role", "both", "--held-state-rows", "1MiB"]).held_state_rows == 2**20
    assert parse_args(["--role", "both"]).held_state_rows is None
    with pytest.raises(SystemExit):
        parse_args(["--role", "both", "--held-state-rows", "-1"])
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt-ids", "3,4", "--held-state-rows", "x"])
    assert e.value.code == 2


def test_overlap_transfer_reaches_the_config_and_is_refused_for_vllm(monkeypatch, tmp_path, capsys):
    """`serve --overlap-transfer` (or YAML `overlap_transfer: true`) reaches ServeConfig;
    off by default; engine vllm refuses it before anything starts. The proxy's own command
    takes the flag too, and workers take the prefill chunk (--max-num-batched-tokens)."""
    import argparse

    from hybrid_pd.proxy.__main__ import add_arguments
    from hybrid_pd.workers.main import parse_args

    assert _deployed_config(monkeypatch, ["serve", "--port", "0"]).overlap_transfer is False
    on = _deployed_config(monkeypatch, ["serve", "--port", "0", "--overlap-transfer"])
    assert on.overlap_transfer is True
    path = tmp_path / "serve.yaml"
    path.write_text("overlap_transfer: true\n")
    assert ServeConfig.from_yaml(path).overlap_transfer is True
    with pytest.raises(ValueError, match="engine hybrid-pd only"):
        ServeConfig(engine="vllm", model="some/folder", overlap_transfer=True)
    # with tensor-parallel workers of the sizes it was verified with (1, 2, 4), not others
    tp = ["--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "4"]
    on = _deployed_config(monkeypatch, ["serve", "--port", "0", "--overlap-transfer", *tp])
    assert on.overlap_transfer and (on.tp_size("prefill"), on.tp_size("decode")) == (2, 4)
    assert cli.main(["serve", "--overlap-transfer", "--tensor-parallel-size", "3"]) == 2
    assert "verified with tensor-parallel sizes 1, 2 and 4 only" in capsys.readouterr().err
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--decode", "127.0.0.1:1", "--overlap-transfer"]).overlap_transfer
    assert not p.parse_args(["--decode", "127.0.0.1:1"]).overlap_transfer
    args = parse_args(["--role", "prefill", "--max-num-batched-tokens", "512"])
    assert args.max_num_batched_tokens == 512
    assert parse_args(["--role", "prefill"]).max_num_batched_tokens == 2048
    for flag in ("--max-num-batched-tokens", "--max-num-seqs"):
        with pytest.raises(SystemExit):  # a clear usage error, not a traceback at start
            parse_args(["--role", "prefill", flag, "0"])
