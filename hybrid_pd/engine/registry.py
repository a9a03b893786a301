"""Architecture registry: `architectures[0]` of a config.json -> model class."""

from __future__ import annotations

import importlib

from torch import nn

#: architecture -> "module:Class" under hybrid_pd.engine.models (imported on first use).
MODEL_REGISTRY: dict[str, str] = {
    "Qwen3_5ForCausalLM": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3NextForCausalLM": "qwen3_5:Qwen3NextForCausalLM",
    "GraniteMoeHybridForCausalLM": "granite_hybrid:GraniteMoeHybridForCausalLM",
    "BambaForCausalLM": "bamba:BambaForCausalLM",
    "JambaForCausalLM": "jamba:JambaForCausalLM",
    "NemotronHForCausalLM": "nemotron_h:NemotronHForCausalLM",
    "FalconH1ForCausalLM": "falcon_h1:FalconH1ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "gemma3:Gemma3ForCausalLM",
    "GptOssForCausalLM": "gpt_oss:GptOssForCausalLM",
    "Llama4ForCausalLM": "llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "llama4:Llama4ForCausalLM",
    "LlamaForCausalLM": "llama:DenseForCausalLM",
    "MistralForCausalLM": "llama:DenseForCausalLM",
    "Qwen2ForCausalLM": "llama:DenseForCausalLM",
    "Qwen3ForCausalLM": "llama:DenseForCausalLM",
}


class UnsupportedModelError(ValueError):
    pass


def model_class(config: dict) -> type[nn.Module]:
    archs = config.get("architectures") or []
    if not archs:
        raise UnsupportedModelError("config.json has no 'architectures' entry")
    target = MODEL_REGISTRY.get(archs[0])
    if target is None:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise UnsupportedModelError(
            f"the engine cannot run architecture {archs[0]!r}; supported: {known}"
        )
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"hybrid_pd.engine.models.{module}"), cls)
