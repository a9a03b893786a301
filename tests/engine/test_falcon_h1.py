"""Falcon-H1 (attention beside Mamba2 in every layer, muP multipliers) against transformers
on the paged pool."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybrid_pd.engine.loader import load_model  # noqa: E402
from hybrid_pd.engine.models.falcon_h1 import FalconH1ForCausalLM, NormThenGate  # noqa: E402
from hybrid_pd.engine.models.rope import inverse_frequencies  # noqa: E402
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config  # noqa: E402
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from hybrid_pd.kvcache.specs import FullAttentionSpec  # noqa: E402
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
def falcon(tmp_path_factory):
    path = checkpoints.falcon_h1(tmp_path_factory.mktemp("falcon_h1"))
    model, config, tok = load_model(path)
    return model, config, tok, Reference(path)


def test_parameters_are_transformers_own(falcon):
    model, _, _, ref = falcon
    assert isinstance(model, FalconH1ForCausalLM)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == {n: tuple(p.shape) for n, p in ref.hf.named_parameters()}
    for ours_layer, hf_layer in zip(model.model.layers, ref.hf.model.layers, strict=True):
        torch.testing.assert_close(ours_layer.mamba.mup, hf_layer.mamba.mup_vector[0, 0])


def test_every_layer_owns_a_kv_and_a_state_cache_layer(falcon):
    model, config, _, _ = falcon
    names = list(cache_spec_from_config(config).layers)
    want = [f"model.layers.{i}.{m}" for i in range(3) for m in ("self_attn", "mamba")]
    assert names == want
    layer = model.model.layers[1]
    assert (layer.self_attn.name, layer.mamba.name) == (want[2], want[3])
    assert (layer.self_attn.head_dim, layer.self_attn.rotary_dim) == (32, 32)  # not 64 / 4
    assert (layer.mamba.inner, layer.mamba.head_dim) == (96, 12)  # mamba_d_ssm, not 2 x 64
    runner = PagedRunner(model, config)
    kinds = {g.kind: len(g.layer_names) for g in runner.config.groups}
    assert kinds.keys() == {"full", "state"}


def test_one_token_and_long_prompt(falcon):
    # 300 tokens: about 19 Mamba2 chunks of 16
    model, config, _, ref = falcon
    prompts = [[7], prompt(300, 2)]
    check_runner(ref, PagedRunner(model, config), prompts)
    check_distinct(ref, [*prompts, prompt(40, 3)])


def test_a_dropped_multiplier_breaks_parity(falcon):
    """The parity checks see each muP multiplier: without the key multiplier the logits move
    far past the tolerance."""
    model, config, _, ref = falcon
    layer = model.model.layers[0].self_attn
    kept = layer.key_multiplier
    layer.key_multiplier = 1.0
    try:
        with pytest.raises(AssertionError):
            check_runner(ref, PagedRunner(model, config), [prompt(40, 3)])
    finally:
        layer.key_multiplier = kept
    check_runner(ref, PagedRunner(model, config), [prompt(40, 3)])


def test_batched_different_lengths(falcon):
    model, config, _, ref = falcon
    check_runner(ref, PagedRunner(model, config), [prompt(n, 10 + n) for n in (3, 17, 45, 130)])


@pytest.mark.parametrize("chunk", [7, 23])
def test_chunked_prefill_cuts_mamba_chunks(falcon, chunk):
    # chunks of 7 / 23 tokens: aligned neither to blocks (4) nor to Mamba2 chunks (16); the
    # other prompt decodes while this one still prefills
    model, config, _, ref = falcon
    check_runner(ref, PagedRunner(model, config), [prompt(150, 3), prompt(9, 4)], chunk=chunk)


def test_prefix_cache_hit_from_snapshot(falcon):
    model, config, _, ref = falcon
    check_prefix_snapshot(ref, model, config)


def test_prefix_cache_hit_after_finish(falcon):
    model, config, _, ref = falcon
    check_prefix_after_finish(ref, model, config)


def test_engine_batched_chunked_with_prefix_hits(falcon):
    model, config, tok, ref = falcon
    check_engine(ref, model, config, tok)


@pytest.mark.parametrize(
    "overrides",
    [
        # the norm before the gate; tied embeddings
        dict(name="norm_first", mamba_norm_before_gate=True, tie_word_embeddings=True),
        # no norm (y * silu(z)), inner size mamba_expand x hidden, no out_proj bias
        dict(name="no_norm", mamba_rms_norm=False, mamba_d_ssm=None, projectors_bias=False),
    ],
    ids=["norm_before_gate_tied", "no_norm_expand"],
)
def test_norm_variants_and_inner_size(tmp_path, overrides):
    path = checkpoints.falcon_h1(tmp_path, **overrides)
    model, config, _ = load_model(path)
    norm = model.model.layers[0].mamba.norm
    if overrides.get("mamba_rms_norm") is False:
        assert norm is None and model.model.layers[0].mamba.inner == 128
    else:
        assert isinstance(norm, NormThenGate) and model.lm_head is None
    check_runner(Reference(path), PagedRunner(model, config), [prompt(70, 11)], chunk=13)


def test_published_config_resolves_as_transformers():
    """Falcon-H1-7B's config.json: attention and Mamba2 sizes, muP vector and RoPE as
    transformers reads them, and the planner's cache specs."""
    config = REFERENCE_CONFIGS["tiiuae/Falcon-H1-7B-Instruct"]
    assert model_class(config) is FalconH1ForCausalLM
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = FalconH1ForCausalLM(config)
        hf_layer = transformers.models.falcon_h1.modeling_falcon_h1.FalconH1DecoderLayer(ref_cfg, 0)
    assert len(model.model.layers) == ref_cfg.num_hidden_layers
    ours = model.model.layers[0]
    mixer = ours.mamba
    assert (mixer.heads, mixer.head_dim, mixer.groups, mixer.state, mixer.chunk) == (
        ref_cfg.mamba_n_heads,
        ref_cfg.mamba_d_head,
        ref_cfg.mamba_n_groups,
        ref_cfg.mamba_d_state,
        ref_cfg.mamba_chunk_size,
    )
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in hf_layer.named_parameters()}
    mup = transformers.models.falcon_h1.modeling_falcon_h1.compute_mup_vector(ref_cfg)
    torch.testing.assert_close(model.settings.mup_vector(), mup[0, 0], rtol=0, atol=0)
    rope = transformers.models.falcon_h1.modeling_falcon_h1.FalconH1RotaryEmbedding(ref_cfg)
    inv, _ = inverse_frequencies(model.settings.rope, model.settings.head_dim)
    torch.testing.assert_close(inv, rope.inv_freq, rtol=0, atol=0)
    spec = cache_spec_from_config(config)
    attn = spec.layers["model.layers.0.self_attn"]
    assert isinstance(attn, FullAttentionSpec)
    assert (attn.num_kv_heads, attn.head_dim) == (
        ref_cfg.num_key_value_heads,
        hf_layer.self_attn.head_dim,
    )
    state = spec.layers["model.layers.0.mamba"]
    assert state.shapes == ((hf_layer.mamba.conv_dim, ref_cfg.mamba_d_conv - 1), (24, 128, 256))
    s = model.settings
    assert (s.key_mult, s.attn_out, s.ssm_in, s.ssm_out, s.lm_head_mult) == (
        ref_cfg.key_multiplier,
        ref_cfg.attention_out_multiplier,
        ref_cfg.ssm_in_multiplier,
        ref_cfg.ssm_out_multiplier,
        ref_cfg.lm_head_multiplier,
    )
