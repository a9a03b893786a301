"""gpt-oss (attention sinks, sliding + full attention, YaRN, MoE with clamped SwiGLU) against
transformers on the paged pool."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

from hybrid_pd.engine import paged_attention  # noqa: E402
from hybrid_pd.engine.loader import load_model  # noqa: E402
from hybrid_pd.engine.models import attention, gpt_oss  # noqa: E402
from hybrid_pd.engine.models.gpt_oss import GptOssForCausalLM  # noqa: E402
from hybrid_pd.engine.models.rope import inverse_frequencies  # noqa: E402
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config  # noqa: E402
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from hybrid_pd.kvcache.specs import SlidingWindowSpec  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.engine.harness import PagedRunner  # noqa: E402
from tests.engine.mamba2_parity import (  # noqa: E402
    TOL,
    Reference,
    check_distinct,
    check_engine,
    check_nan_pages,
    check_prefix_hit_with_null_blocks,
    check_runner,
    prompt,
)

SLIDING, FULL = "sliding_attention", "full_attention"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    path = checkpoints.gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    model, config, tok = load_model(path)
    return model, config, tok, Reference(path), path


def test_parameters_are_the_checkpoints(gptoss):
    model, _, _, ref, path = gptoss
    assert isinstance(model, GptOssForCausalLM)
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")  # [E, hidden, 2I]
        bias = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias")
    assert set(dict(model.named_parameters())) == names
    # ours: [E, out, in], gate rows (the even columns) then up rows (the odd ones)
    experts = model.model.layers[1].mlp.experts
    inter = gate_up.shape[2] // 2
    torch.testing.assert_close(experts.gate_up_proj[:, :inter], gate_up[..., 0::2].mT)
    torch.testing.assert_close(experts.gate_up_proj[:, inter:], gate_up[..., 1::2].mT)
    torch.testing.assert_close(experts.gate_up_proj_bias[:, inter:], bias[:, 1::2])
    # the random weights exercise what transformers would start at zero / one
    for layer in ref.hf.model.layers:
        assert layer.self_attn.sinks.abs().min() > 0.01
        assert layer.mlp.experts.gate_up_proj_bias.abs().max() > 0.1


def test_layer_kinds_and_windows(gptoss):
    model, config, _, ref, _ = gptoss
    kinds = ref.hf.config.layer_types
    assert kinds == [SLIDING, FULL, SLIDING, FULL]
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [checkpoints.SW_WINDOW if k == SLIDING else None for k in kinds]
    specs = cache_spec_from_config(config, dtype="float32").layers
    assert [isinstance(specs[f"model.layers.{i}"], SlidingWindowSpec) for i in range(4)] == [
        k == SLIDING for k in kinds
    ]
    rope = ref.hf.model.rotary_emb
    assert rope.rope_type == "yarn" and rope.attention_scaling != 1.0
    torch.testing.assert_close(model.model.inv_freq, rope.inv_freq, rtol=0, atol=0)
    assert model.model.rope_scale == pytest.approx(rope.attention_scaling, rel=1e-12)


def test_one_token_and_long_prompt(gptoss):
    model, config, _, ref, _ = gptoss
    prompts = [[7], prompt(300, 2)]  # 300 tokens: far past the 16-token window
    worst = check_runner(ref, PagedRunner(model, config), prompts)
    print(f"max logit diff {worst:.2e}")
    check_distinct(ref, [*prompts, prompt(40, 3), prompt(40, 4)])


def test_ignoring_the_sinks_breaks_parity(gptoss, monkeypatch):
    """The parity checks can fail: attention without the sinks, on the one-token path
    (decode rows) and on a prefill chunk, moves the logits far past TOL."""
    model, config, _, ref, _ = gptoss

    def no_sinks(*args, sinks=None, **kwargs):
        return paged_attention.paged_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "paged_attention", no_sinks)  # gpt-oss attention's call
    prompts = [[7], prompt(40, 5)]
    _, first = PagedRunner(model, config).generate(prompts, 1)
    for p, logits in zip(prompts, first, strict=True):
        assert (logits - ref(p)[0]).abs().max().item() > 100 * TOL


def test_batched_different_lengths(gptoss):
    model, config, _, ref, _ = gptoss
    prompts = [prompt(n, 10 + n) for n in (3, 15, 17, 45, 130)]
    check_runner(ref, PagedRunner(model, config), prompts)


@pytest.mark.parametrize("chunk", [7, 23])  # shorter / longer than the window, not aligned
def test_chunked_prefill_mixed_with_decode(gptoss, chunk):
    # the 5-token prompt decodes while the others still prefill: mixed batches
    model, config, _, ref, _ = gptoss
    prompts = [prompt(150, 3), prompt(5, 8), prompt(61, 4)]
    check_runner(ref, PagedRunner(model, config), prompts, chunk=chunk)


def test_mixed_steps_over_stale_nan_pages(gptoss, monkeypatch):
    model, config, _, ref, _ = gptoss
    check_nan_pages(ref, model, config, monkeypatch)


def test_prefix_cache_hit_with_null_sliding_blocks(gptoss):
    model, config, _, ref, _ = gptoss
    check_prefix_hit_with_null_blocks(ref, model, config, "model.layers.0", "model.layers.1")


def test_engine_batched_chunked_with_prefix_hits(gptoss):
    model, config, tok, ref, _ = gptoss
    check_engine(ref, model, config, tok)


def test_published_config_matches_planner_and_transformers():
    """gpt-oss-20b's config.json: layer kinds and windows as the planner and transformers
    read them, head geometry, MoE sizes and the YaRN frequencies."""
    config = REFERENCE_CONFIGS["openai/gpt-oss-20b"]
    assert model_class(config) is GptOssForCausalLM
    fields = copy.deepcopy(config)
    fields.pop("quantization_config")
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = GptOssForCausalLM(config)
    specs = cache_spec_from_config(config, dtype="bfloat16").layers
    layers = model.model.layers
    assert len(layers) == len(specs) == ref_cfg.num_hidden_layers == 24
    for i, (layer, kind) in enumerate(zip(layers, ref_cfg.layer_types, strict=True)):
        spec = specs[f"model.layers.{i}"]
        assert isinstance(spec, SlidingWindowSpec) == (kind == SLIDING)
        assert layer.self_attn.window == (ref_cfg.sliding_window if kind == SLIDING else None)
        assert (spec.num_kv_heads, spec.head_dim) == (8, 64)
    attn = layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (64, 8, 64)
    assert attn.sinks.shape == (64,)
    experts = layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (32, 2 * 2880, 2880)
    assert layers[0].mlp.top_k == ref_cfg.num_experts_per_tok == 4
    assert (experts.limit, experts.alpha) == (ref_cfg.swiglu_limit, ref_cfg.swiglu_alpha)
    _check_rope(config, ref_cfg)


def _check_rope(config, ref_cfg) -> None:
    """Our inverse frequencies and cos/sin factor (built on the CPU, not the meta device)
    equal transformers' for the config."""
    s = gpt_oss._Settings(config)
    inv, scale = inverse_frequencies(s.rope, s.head_dim)
    rope = modeling_gpt_oss.GptOssRotaryEmbedding(ref_cfg)
    assert rope.rope_type == "yarn"
    torch.testing.assert_close(inv, rope.inv_freq, rtol=0, atol=0)
    assert scale == pytest.approx(rope.attention_scaling, rel=1e-12)


def test_config_without_rope_fields_takes_transformers_defaults():
    config = copy.deepcopy(REFERENCE_CONFIGS["openai/gpt-oss-20b"])
    for key in ("rope_scaling", "rope_theta", "quantization_config"):
        config.pop(key)
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    _check_rope(config, ref_cfg)


def test_mxfp4_checkpoint_is_refused(gptoss):
    _, config, _, _, _ = gptoss
    model = GptOssForCausalLM(config)
    blocks = torch.zeros(4, 96, 2, 16, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        model.load_weights([("model.layers.0.mlp.experts.gate_up_proj_blocks", blocks)])
