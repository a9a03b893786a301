"""Load a Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer.json."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from hybrid_pd.api.tokenizer import Tokenizer
from hybrid_pd.engine.onednn import use_onednn_linears
from hybrid_pd.engine.registry import model_class
from hybrid_pd.engine.tp.build import shard_model
from hybrid_pd.engine.tp.group import SINGLE, TPGroup
from hybrid_pd.engine.tp.plans import plan_for
from hybrid_pd.kvcache.hf_configs import load_config
from hybrid_pd.kvcache.tp_layout import TP_CONFIG_KEY

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, shards included (per the index when there is one)."""
    from safetensors.torch import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: str | None = None,
    tp: TPGroup = SINGLE,
):
    """(model, config dict, tokenizer or None) for a checkpoint folder.

    With a tensor-parallel group of several ranks, the model is this rank's shard and the
    config its rank config (`engine.tp.plans`): its head and width counts are this rank's
    share, so the engine's cache plan gives this rank's pool. Each rank reads the whole
    checkpoint once, on the CPU, and keeps its shard."""
    folder = Path(path)
    config = load_config(folder)
    cls = model_class(config)
    text = config.get("text_config") or config
    name = dtype or text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype")
    torch_dtype = DTYPES.get(str(name or "float32").removeprefix("torch."), torch.float32)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "cpu" and torch_dtype is torch.float16:
        torch_dtype = torch.float32  # fp16 matmuls are slow or missing on CPU
    if tp.size > 1:
        plan = plan_for(config, tp.size)
        with torch.device("cpu"):
            full = cls(config)
        full.load_weights(iter_safetensors(folder))
        with device:
            model = cls(plan.rank_config)
        shard_model(full, model, plan, tp)
        whole = sum(p.numel() for p in full.parameters())
        config = {
            **plan.rank_config,
            TP_CONFIG_KEY: {"size": tp.size, "config": config, "parameters": whole},
        }
        del full
    else:
        with device:
            model = cls(config)
        model.load_weights(iter_safetensors(folder))
    model.to(dtype=torch_dtype)
    model.eval()
    if device.type == "cpu":
        use_onednn_linears(model)
    tokenizer = Tokenizer(folder) if (folder / "tokenizer.json").exists() else None
    logger.info("loaded %s from %s (%s)", config["architectures"][0], folder, torch_dtype)
    return model, config, tokenizer
