"""Qwen3-Next (Gated DeltaNet with fused per-key-head projections + gated attention, MoE with
a gated shared expert) against transformers on the paged pool."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from hybrid_pd.engine.loader import load_model  # noqa: E402
from hybrid_pd.engine.models.common import GatedMLP  # noqa: E402
from hybrid_pd.engine.models.qwen3_5 import (  # noqa: E402
    Qwen3NextForCausalLM,
    SparseMoE,
    _split_checkpoint_tensor,
)
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config  # noqa: E402
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from hybrid_pd.kvcache.specs import AttentionSpec  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.engine.harness import PagedRunner  # noqa: E402
from tests.engine.mamba2_parity import (  # noqa: E402
    Reference,
    check_distinct,
    check_engine,
    check_prefix_after_finish,
    check_prefix_snapshot,
    check_runner,
    prompt,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    path = checkpoints.qwen3_next(tmp_path_factory.mktemp("qwen3_next"))
    model, config, tok = load_model(path)
    return model, config, tok, Reference(path), path


def _kinds(model) -> list[str]:
    return [layer.kind for layer in model.model.layers]


def _moe(model) -> list[bool]:
    return [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]


def test_parameters_are_the_checkpoints(qwen3_next):
    """Every checkpoint tensor lands, unchanged, in one parameter (per-expert tensors in one
    slice of the stacked expert weights), and every parameter is filled."""
    model, _, _, _, path = qwen3_next
    assert isinstance(model, Qwen3NextForCausalLM)
    params = dict(model.named_parameters())
    filled = set()
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        for name in names:
            for target, expert, part in _split_checkpoint_tensor(name, f.get_tensor(name)):
                dest = params[target] if expert is None else params[target][expert]
                assert torch.equal(dest, part), name
                filled.add(target)
    assert filled == set(params)
    assert any(".linear_attn.in_proj_qkvz." in n for n in names)
    assert any(".linear_attn.in_proj_ba." in n for n in names)
    assert any(".mlp.shared_expert_gate." in n for n in names)


def test_layer_kinds_and_experts(qwen3_next):
    model, _, _, ref, _ = qwen3_next
    assert _kinds(model) == ref.hf.config.layer_types
    assert _kinds(model) == ["linear_attention", "full_attention"] * 2
    hf_moe = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.hf.model.layers]
    assert _moe(model) == hf_moe == [True, True, False, True]  # mlp_only_layers=[2]
    assert model.model.layers[2].mlp.gate_proj.out_features == 96  # intermediate_size


def test_fused_expert_weights_load(qwen3_next):
    """transformers' in-memory names (experts.gate_up_proj / down_proj stacked) load too."""
    model, config, _, ref, _ = qwen3_next
    other = Qwen3NextForCausalLM(config)
    other.load_weights(ref.hf.state_dict().items())
    mine = dict(model.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(mine[name], p), name


def test_one_token_and_long_prompt(qwen3_next):
    """300 tokens: several 64-token GDN chunks in one prefill."""
    model, config, _, ref, _ = qwen3_next
    prompts = [[7], prompt(300, 2)]
    worst = check_runner(ref, PagedRunner(model, config), prompts)
    print(f"max logit diff {worst:.2e}")
    check_distinct(ref, [*prompts, prompt(40, 3), prompt(40, 4)])


def test_batched_different_lengths(qwen3_next):
    model, config, _, ref, _ = qwen3_next
    check_runner(ref, PagedRunner(model, config), [prompt(n, 10 + n) for n in (3, 17, 45, 130)])


@pytest.mark.parametrize("chunk", [7, 37])
def test_chunked_prefill_mixed_with_decode(qwen3_next, chunk):
    # the 5-token prompt decodes while the others still prefill: mixed batches; the
    # 150-token prompt's steps cut GDN chunks of 64 mid-way
    model, config, _, ref, _ = qwen3_next
    prompts = [prompt(150, 3), prompt(5, 8), prompt(61, 4)]
    check_runner(ref, PagedRunner(model, config), prompts, chunk=chunk)


def test_prefix_cache_hit_from_snapshot(qwen3_next):
    model, config, _, ref, _ = qwen3_next
    check_prefix_snapshot(ref, model, config)


def test_prefix_cache_hit_after_finish(qwen3_next):
    model, config, _, ref, _ = qwen3_next
    check_prefix_after_finish(ref, model, config)


def test_engine_batched_chunked_with_prefix_hits(qwen3_next):
    model, config, tok, ref, _ = qwen3_next
    check_engine(ref, model, config, tok)


def test_variant_switches(tmp_path):
    """Tied embeddings, top-k weights not renormalised, MoE every second layer
    (decoder_sparse_step 2), one attention layer in four, value heads = key heads."""
    path = checkpoints.qwen3_next(
        tmp_path,
        name="variant",
        tie_word_embeddings=True,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        full_attention_interval=4,
        linear_num_value_heads=2,
    )
    model, config, _ = load_model(path)
    ref = Reference(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (
        _kinds(model) == ref.hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    )
    assert _moe(model) == [False, True, False, True]
    assert not model.model.layers[1].mlp.norm_topk
    check_runner(ref, PagedRunner(model, config), [prompt(90, 11), [5]], chunk=13)


def test_published_config_matches_planner_and_transformers():
    """Qwen3-Next-80B-A3B's config.json: layer kinds and MoE layers as transformers reads
    them, and GDN state / attention KV pages the planner's shape."""
    name = "Qwen/Qwen3-Next-80B-A3B-Instruct"
    config = REFERENCE_CONFIGS[name]
    assert model_class(config) is Qwen3NextForCausalLM
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    layers = model.model.layers
    assert _kinds(model) == list(ref_cfg.layer_types)
    assert _kinds(model)[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert all(_moe(model)) and len(layers) == 48
    moe = layers[0].mlp
    assert (moe.num_experts, moe.top_k, moe.norm_topk) == (512, 10, True)
    assert isinstance(moe.shared_expert, GatedMLP)
    specs = cache_spec_from_config(config, dtype="bfloat16").layers
    for i, layer in enumerate(layers):
        spec = specs[f"model.layers.{i}"]
        if layer.kind == "linear_attention":
            gdn = layer.linear_attn
            assert tuple(spec.shapes) == (
                (gdn.conv_dim, gdn.kernel - 1),
                (gdn.v_heads, gdn.dk, gdn.dv),
            )
            assert tuple(spec.shapes) == ((8192, 3), (32, 128, 128))
            assert gdn.in_proj_qkvz.out_features == 2 * 16 * 128 + 2 * 32 * 128
            assert gdn.in_proj_ba.out_features == 2 * 32
        else:
            attn = layer.self_attn
            assert isinstance(spec, AttentionSpec)
            assert (spec.num_kv_heads, spec.head_dim) == (attn.num_kv_heads, attn.head_dim)
            assert (attn.num_kv_heads, attn.head_dim, attn.rotary.rotary_dim) == (2, 256, 64)
