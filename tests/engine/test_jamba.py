"""Jamba (Mamba1 + attention without RoPE, MoE) against transformers on the paged pool."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from hybrid_pd.engine.loader import load_model  # noqa: E402
from hybrid_pd.engine.models.jamba import JambaForCausalLM, SparseMoE  # noqa: E402
from hybrid_pd.engine.models.mamba1 import check_state_spec  # noqa: E402
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config  # noqa: E402
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from hybrid_pd.kvcache.specs import mamba2_state_spec  # noqa: E402
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
def jamba(tmp_path_factory):
    path = checkpoints.jamba(tmp_path_factory.mktemp("jamba"))
    model, config, tok = load_model(path)
    return model, config, tok, Reference(path), path


def test_parameters_are_the_checkpoints(jamba):
    model, _, _, _, path = jamba
    assert isinstance(model, JambaForCausalLM)
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert set(dict(model.named_parameters())) == names


def test_layer_kinds_and_experts(jamba):
    model, _, _, ref, _ = jamba
    kinds = ["attention" if layer.mamba is None else "mamba" for layer in model.model.layers]
    assert (
        kinds
        == ref.hf.config.layers_block_type
        == ["mamba", "attention", "mamba", "mamba", "attention"]
    )
    moe = [isinstance(layer.feed_forward, SparseMoE) for layer in model.model.layers]
    assert moe == [n > 1 for n in ref.hf.config.layers_num_experts]
    assert moe == [False, True, False, True, False]


def test_fused_expert_weights_load(jamba):
    """transformers' in-memory names (experts.gate_up_proj / down_proj stacked) load too."""
    model, config, _, ref, _ = jamba
    other = JambaForCausalLM(config)
    other.load_weights(ref.hf.state_dict().items())
    for name, p in model.named_parameters():
        torch.testing.assert_close(dict(other.named_parameters())[name], p, rtol=0, atol=0)


def test_one_token_and_long_prompt(jamba):
    model, config, _, ref, _ = jamba
    prompts = [[7], prompt(300, 2)]
    worst = check_runner(ref, PagedRunner(model, config), prompts)
    print(f"max logit diff {worst:.2e}")
    check_distinct(ref, [*prompts, prompt(40, 3), prompt(40, 4)])


def test_batched_different_lengths(jamba):
    model, config, _, ref, _ = jamba
    check_runner(ref, PagedRunner(model, config), [prompt(n, 10 + n) for n in (3, 17, 45, 130)])


@pytest.mark.parametrize("chunk", [7, 23])
def test_chunked_prefill_mixed_with_decode(jamba, chunk):
    # the 5-token prompt decodes while the others still prefill: mixed batches
    model, config, _, ref, _ = jamba
    prompts = [prompt(150, 3), prompt(5, 8), prompt(61, 4)]
    check_runner(ref, PagedRunner(model, config), prompts, chunk=chunk)


def test_prefix_cache_hit_from_snapshot(jamba):
    model, config, _, ref, _ = jamba
    check_prefix_snapshot(ref, model, config)


def test_prefix_cache_hit_after_finish(jamba):
    model, config, _, ref, _ = jamba
    check_prefix_after_finish(ref, model, config)


def test_engine_batched_chunked_with_prefix_hits(jamba):
    model, config, tok, ref, _ = jamba
    check_engine(ref, model, config, tok)


def test_tied_embeddings_and_auto_dt_rank(tmp_path):
    path = checkpoints.jamba(
        tmp_path, name="tied", tie_word_embeddings=True, mamba_dt_rank="auto", mamba_proj_bias=False
    )
    model, config, _ = load_model(path)
    assert model.lm_head is None
    assert model.model.layers[0].mamba.dt_rank == 4  # ceil(64 / 16)
    check_runner(Reference(path), PagedRunner(model, config), [prompt(70, 11)], chunk=13)


def test_published_config_matches_planner_and_transformers():
    """Jamba-v0.1's config.json: layer kinds, MoE layers and Mamba1 sizes as transformers
    reads them, and state pages the planner's shape."""
    config = REFERENCE_CONFIGS["ai21labs/Jamba-v0.1"]
    assert model_class(config) is JambaForCausalLM
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = JambaForCausalLM(config)
    layers = model.model.layers
    assert [layer.mamba is None for layer in layers] == [
        k == "attention" for k in ref_cfg.layers_block_type
    ]
    assert [isinstance(layer.feed_forward, SparseMoE) for layer in layers] == [
        n > 1 for n in ref_cfg.layers_num_experts
    ]
    mixer = layers[0].mamba
    assert (mixer.inner, mixer.state, mixer.dt_rank) == (
        ref_cfg.mamba_expand * ref_cfg.hidden_size,
        ref_cfg.mamba_d_state,
        ref_cfg.mamba_dt_rank,
    )
    spec = cache_spec_from_config(config, dtype="bfloat16").layers["model.layers.0"]
    assert tuple(spec.shapes) == ((8192, 3), (8192, 16))


def test_state_spec_mismatch_raises():
    config = REFERENCE_CONFIGS["ai21labs/Jamba-v0.1"]
    with torch.device("meta"):
        dims = JambaForCausalLM(config).settings.mamba
    wrong = mamba2_state_spec(num_heads=128, head_dim=64, n_groups=1, state_size=16, conv_kernel=4)
    with pytest.raises(ValueError, match="Mamba1 layer"):
        check_state_spec(dims, wrong, "model.layers.0", "Jamba")
