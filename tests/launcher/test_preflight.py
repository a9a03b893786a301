"""What `serve` and `generate` refuse before anything starts: one line, exit status 2, in a
second or two (no Ray, no worker, no model load)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from hybrid_pd.launcher.preflight import PreflightError, check_device, check_model

pytestmark = pytest.mark.timeout(120)


def checkpoint(tmp_path, config: dict, weights: bool = True, tokenizer: str | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if weights:
        (tmp_path / "model.safetensors").write_bytes(b"")
    if tokenizer is not None:
        (tmp_path / "tokenizer.json").write_text(tokenizer)
    return tmp_path


def run_cli(*argv: str) -> tuple[int, str, float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "hybrid_pd.launcher.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, out.stderr, time.monotonic() - start


def test_unsupported_architecture_is_refused_before_ray(tmp_path):
    folder = checkpoint(tmp_path / "zamba2", {"architectures": ["Zamba2ForCausalLM"]})
    for argv in (
        ("serve", "--model", str(folder), "--port", "0"),
        ("generate", "--model", str(folder), "--prompt", "hi"),
    ):
        rc, err, seconds = run_cli(*argv)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2, err
        assert lines[-1].startswith(f"hybrid-pd {argv[0]}: error: the engine cannot run ")
        assert "'Zamba2ForCausalLM'" in lines[-1] and "Qwen3_5ForCausalLM" in lines[-1]
        assert "Ray" not in err and "Traceback" not in err, err
        assert seconds < 20, seconds  # starting Ray and a worker took 15-45 s


def test_device_that_does_not_exist_is_refused_at_once():
    rc, err, _ = run_cli("serve", "--device", "cuda:99", "--port", "0")
    assert rc == 2 and "--device cuda:99" in err and "Traceback" not in err, err
    rc, err, _ = run_cli("generate", "--device", "cuda:99", "--prompt", "hi")
    assert rc == 2 and "--device cuda:99" in err, err
    with pytest.raises(PreflightError, match="not a device"):
        check_device("warp-drive")
    check_device("cpu")
    check_device(None)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> dict:
    from hybrid_pd.engine.tiny import ensure_tiny

    folder = ensure_tiny(tmp_path_factory.mktemp("cache"))
    check_model(str(folder))  # the real thing passes
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize(
    "change, weights, tokenizer, words",
    [
        (None, True, None, "not a checkpoint folder"),
        ({"architectures": []}, True, None, "no 'architectures'"),
        ({"layer_types": ["bogus"] * 6}, True, None, "config.json: .*bogus"),
        ({"dtype": "float8", "torch_dtype": None, "text_config": None}, True, None, "float8"),
        ({}, False, None, "safetensors"),
        ({}, True, "{not json", "tokenizer.json does not load"),
    ],
)
def test_checkpoint_problems_are_named(tmp_path, tiny_config, change, weights, tokenizer, words):
    folder = tmp_path / "ckpt"
    if change is None:
        folder.mkdir()
    else:
        config = {k: v for k, v in {**tiny_config, **change}.items() if v is not None}
        checkpoint(folder, config, weights, tokenizer)
    with pytest.raises(PreflightError, match=words):
        check_model(str(folder))


def test_vllm_python_must_have_vllm_and_hybrid_pd():
    import importlib.util

    from hybrid_pd.launcher.preflight import check_python

    with pytest.raises(PreflightError, match="no such executable"):
        check_python("/nonexistent/python")
    if importlib.util.find_spec("vllm") is None:  # this suite's own environment
        with pytest.raises(PreflightError, match="vllm is not importable"):
            check_python(sys.executable)
    else:
        check_python(sys.executable)
    rc, err, _ = run_cli("serve", "--engine", "vllm", "--port", "0")  # the built-in model
    assert rc == 2 and "engine vllm serves a checkpoint folder" in err, err
