"""Per-family tensor-parallel plans: what a rank's model looks like, which weights split
how, and where partial sums meet (`base.TPPlan`). One module per family; `plan_for`
refuses an architecture that has none yet, naming those that do."""

from __future__ import annotations

from collections.abc import Callable

from hybrid_pd.engine.tp.plans import (
    bamba,
    dense,
    falcon_h1,
    gpt_oss,
    granite,
    jamba,
    llama4,
    nemotron_h,
    qwen3_5,
)
from hybrid_pd.engine.tp.plans.base import TPConfigError, TPPlan

__all__ = ["TPConfigError", "TPPlan", "plan_for"]

_PLANS: dict[str, Callable[[dict, int], TPPlan]] = {
    "LlamaForCausalLM": dense.plan,
    "MistralForCausalLM": dense.plan,
    "Qwen2ForCausalLM": dense.plan,
    "Qwen3ForCausalLM": dense.plan,
    "Gemma3ForCausalLM": dense.plan,
    "Gemma3ForConditionalGeneration": dense.plan,
    "GraniteMoeHybridForCausalLM": granite.plan,
    "BambaForCausalLM": bamba.plan,
    "FalconH1ForCausalLM": falcon_h1.plan,
    "NemotronHForCausalLM": nemotron_h.plan,
    "Qwen3_5ForCausalLM": qwen3_5.plan,
    "Qwen3_5ForConditionalGeneration": qwen3_5.plan,
    "Qwen3_5MoeForCausalLM": qwen3_5.plan,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5.plan,
    "Qwen3NextForCausalLM": qwen3_5.plan,
    "JambaForCausalLM": jamba.plan,
    "GptOssForCausalLM": gpt_oss.plan,
    "Llama4ForCausalLM": llama4.plan,
    "Llama4ForConditionalGeneration": llama4.plan,
}


def plan_for(config: dict, size: int) -> TPPlan:
    """The plan for `config` over `size` ranks; TPConfigError when the architecture has
    none yet or its sizes do not split."""
    arch = (config.get("architectures") or ["?"])[0]
    build = _PLANS.get(arch)
    if build is None:
        raise TPConfigError(
            f"tensor parallelism is not available for {arch} yet; it is for: "
            + ", ".join(sorted(set(_PLANS)))
        )
    return build(config, size)
