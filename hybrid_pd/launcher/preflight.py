"""Checks that run before anything starts (Ray, workers, a model load): the checkpoint is
one the engine can run, and the device exists. Each failure is one line that says what is
wrong and what would work."""

from __future__ import annotations

import json
from pathlib import Path


class PreflightError(ValueError):
    pass


def check_model(model: str, engine: str = "hybrid-pd") -> None:
    """`tiny`, or a checkpoint folder whose architecture, config, weights and tokenizer the
    engine can use (engine "vllm": vLLM judges the architecture itself). Raises
    PreflightError naming the problem."""
    from hybrid_pd.engine.tiny import TINY_NAME

    if model == TINY_NAME:
        return
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise PreflightError(
            f"{model} is not a checkpoint folder (no config.json); give a folder with "
            "config.json, *.safetensors and tokenizer.json, or `tiny`"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise PreflightError(f"{folder / 'config.json'} is not readable JSON: {e}") from None
    if engine == "hybrid-pd":
        _check_architecture(config)
    _check_dtype(config)
    if not any(folder.glob("*.safetensors")):
        raise PreflightError(f"{model} holds no *.safetensors weights")
    if (folder / "tokenizer.json").exists():
        try:
            from tokenizers import Tokenizer

            Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the library's own error types vary
            raise PreflightError(f"{folder / 'tokenizer.json'} does not load: {e}") from None


def _check_architecture(config: dict) -> None:
    from hybrid_pd.engine.registry import MODEL_REGISTRY
    from hybrid_pd.kvcache.hf_configs import cache_spec_from_config

    archs = config.get("architectures") or []
    if not archs:
        raise PreflightError("config.json has no 'architectures' entry")
    if archs[0] not in MODEL_REGISTRY:
        raise PreflightError(
            f"the engine cannot run architecture {archs[0]!r}; it runs "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        )
    try:
        cache_spec_from_config(config)
    except ValueError as e:
        raise PreflightError(f"config.json: {e}") from None


def _check_dtype(config: dict) -> None:
    from hybrid_pd.engine.loader import DTYPES  # the weight dtypes the loader knows

    text = config.get("text_config") or {}
    for source in (text, config):
        name = source.get("dtype") or source.get("torch_dtype")
        if name is not None:
            if str(name).removeprefix("torch.") not in DTYPES:
                raise PreflightError(
                    f"config.json: weight dtype {name!r} is not one of {', '.join(DTYPES)}"
                )
            return


def check_device(device: str | None) -> None:
    """`device` (a torch device string) exists on this machine; None: torch's default."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise PreflightError(f"--device {device!r} is not a device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PreflightError(
                f"--device {device}: this machine has no CUDA device (torch "
                f"{torch.__version__} sees none); leave --device out to run on CPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise PreflightError(
                f"--device {device}: there are {torch.cuda.device_count()} CUDA devices"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise PreflightError(f"--device {device}: MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise PreflightError(f"--device {device}: use cpu, cuda[:N] or mps")


def check_python(python: str) -> None:
    """`python` is an interpreter this machine can run, with vLLM and hybrid-pd installed
    (engine vllm's servers run under it). Looks the packages up without importing them."""
    import os
    import shutil
    import subprocess

    path = shutil.which(python) or python
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise PreflightError(f"--vllm-python {python}: no such executable")
    modules = ("vllm", "hybrid_pd")
    probe = f"import importlib.util as u; print(*(u.find_spec(m) is None for m in {modules}))"
    try:
        out = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PreflightError(f"--vllm-python {python}: cannot run it ({e})") from None
    flags = out.stdout.split()
    missing = [m for m, gone in zip(modules, flags, strict=False) if gone == "True"]
    if out.returncode != 0 or missing:
        raise PreflightError(
            f"--vllm-python {python}: {' and '.join(missing) or 'the probe'} "
            f"{'is' if len(missing) < 2 else 'are'} not importable there (see docs/vllm.md, "
            "Install; or set HYBRID_PD_VLLM_PYTHON)"
        )
