"""Llama 4's text model (chunked local attention on RoPE layers with pair-wise RoPE and L2
q/k norm, NoPE full-attention layers with temperature tuning, sigmoid top-k MoE with a shared
expert) against transformers on the paged pool."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers.models.llama4 import modeling_llama4  # noqa: E402

from hybrid_pd.engine.loader import load_model  # noqa: E402
from hybrid_pd.engine.models import llama4  # noqa: E402
from hybrid_pd.engine.models.common import GatedMLP  # noqa: E402
from hybrid_pd.engine.models.llama4 import Llama4ForCausalLM, MoE  # noqa: E402
from hybrid_pd.engine.models.rope import inverse_frequencies, rotate  # noqa: E402
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config  # noqa: E402
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from hybrid_pd.kvcache.specs import ChunkedLocalSpec  # noqa: E402
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

CHUNKED, FULL = "chunked_attention", "full_attention"
SCOUT = "meta-llama/Llama-4-Scout-17B-16E-Instruct"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def l4(tmp_path_factory):
    path = checkpoints.llama4(tmp_path_factory.mktemp("llama4"))
    model, config, tok = load_model(path)
    return model, config, tok, Reference(path), path


def test_parameters_are_the_checkpoints(l4):
    model, _, _, ref, path = l4
    assert isinstance(model, Llama4ForCausalLM)
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        gate_up = f.get_tensor("model.layers.1.feed_forward.experts.gate_up_proj")
        down = f.get_tensor("model.layers.2.feed_forward.experts.down_proj")
    assert set(dict(model.named_parameters())) == names
    # ours: [E, out, in]; the checkpoint's gate columns first, then the up columns
    torch.testing.assert_close(model.model.layers[1].feed_forward.experts.gate_up_proj, gate_up.mT)
    torch.testing.assert_close(model.model.layers[2].feed_forward.experts.down_proj, down.mT)
    kinds = [type(layer.feed_forward) for layer in model.model.layers]
    assert kinds == [GatedMLP, MoE, MoE, GatedMLP] and ref.hf.config.moe_layers == [1, 2]
    assert model.model.layers[0].feed_forward.gate_proj.out_features == 96  # intermediate_size_mlp


def test_layer_kinds_chunks_and_rope(l4):
    model, config, _, ref, _ = l4
    cfg = ref.hf.config
    assert cfg.layer_types == [CHUNKED, FULL, CHUNKED, FULL]
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.use_rope for a in attns] == [bool(f) for f in cfg.no_rope_layers]
    assert [a.chunk for a in attns] == [
        checkpoints.SW_WINDOW if k == CHUNKED else None for k in cfg.layer_types
    ]
    specs = cache_spec_from_config(config, dtype="float32").layers
    assert [isinstance(specs[f"model.layers.{i}"], ChunkedLocalSpec) for i in range(4)] == [
        k == CHUNKED for k in cfg.layer_types
    ]
    assert [a.qk_norm_eps is not None for a in attns] == [True, False, True, False]
    assert [a.temperature for a in attns] == [None, (4.0, 0.5), None, (4.0, 0.5)]
    rope = ref.hf.model.rotary_emb
    assert rope.rope_type == "llama3"
    torch.testing.assert_close(model.model.inv_freq, rope.inv_freq, rtol=0, atol=0)


def test_one_token_and_long_prompt(l4):
    model, config, _, ref, _ = l4
    prompts = [[7], prompt(90, 2)]  # 90 tokens: six attention chunks of 16
    worst = check_runner(ref, PagedRunner(model, config), prompts)
    print(f"max logit diff {worst:.2e}")
    check_distinct(ref, [*prompts, prompt(40, 3), prompt(40, 4)])


def _half_split_rope(x, cos, sin):
    """The bug: RoPE on the (j, j + D/2) halves, as Llama 1-3, instead of adjacent pairs."""
    both = torch.cat([cos, cos], dim=-1)
    return rotate(x.float(), both, torch.cat([sin, sin], dim=-1)).to(x.dtype)


def _output_weighted_moe(self, x):
    """The bug: the router score weighs the expert's output instead of its input."""
    top_logits, top_idx = self.router(x).topk(self.top_k, dim=-1)
    scores = torch.sigmoid(top_logits)
    out = self.shared_expert(x)
    for e in top_idx.unique().tolist():
        token, slot = torch.nonzero(top_idx == e, as_tuple=True)
        out.index_add_(0, token, self.experts(e, x[token]) * scores[token, slot, None])
    return out


@pytest.mark.parametrize("bug", ["half_rope", "no_temperature", "no_chunks", "no_qk_norm", "moe"])
def test_a_deliberate_bug_breaks_parity(l4, monkeypatch, bug):
    """The parity checks can fail: each of these moves the logits far past TOL."""
    model, config, _, ref, _ = l4
    attns = [layer.self_attn for layer in model.model.layers]
    if bug == "half_rope":
        monkeypatch.setattr(llama4, "rotate_pairs", _half_split_rope)
    elif bug == "moe":
        monkeypatch.setattr(MoE, "forward", _output_weighted_moe)
    else:
        field = {"no_temperature": "temperature", "no_chunks": "chunk"}.get(bug, "qk_norm_eps")
        for a in attns:
            monkeypatch.setattr(a, field, None)
    prompts = [prompt(40, 5), prompt(20, 6)]
    _, first = PagedRunner(model, config).generate(prompts, 1)
    worst = max((lg - ref(p)[0]).abs().max().item() for p, lg in zip(prompts, first, strict=True))
    print(f"{bug}: max logit diff {worst:.2e}")
    assert worst > 100 * TOL, worst


def test_batched_different_lengths(l4):
    model, config, _, ref, _ = l4
    prompts = [prompt(n, 10 + n) for n in (3, 15, 16, 17, 45, 130)]
    check_runner(ref, PagedRunner(model, config), prompts)


@pytest.mark.parametrize("chunk", [7, 23])  # scheduler chunks that cut the attention chunks
def test_chunked_prefill_mixed_with_decode(l4, chunk):
    # the 5-token prompt decodes while the others still prefill: mixed batches
    model, config, _, ref, _ = l4
    prompts = [prompt(150, 3), prompt(5, 8), prompt(61, 4)]
    check_runner(ref, PagedRunner(model, config), prompts, chunk=chunk)


def test_mixed_steps_over_stale_nan_pages(l4, monkeypatch):
    model, config, _, ref, _ = l4
    check_nan_pages(ref, model, config, monkeypatch)


def test_prefix_cache_hit_with_null_chunk_blocks(l4):
    model, config, _, ref, _ = l4
    check_prefix_hit_with_null_blocks(ref, model, config, "model.layers.0", "model.layers.1")


def test_engine_batched_chunked_with_prefix_hits(l4):
    model, config, tok, ref, _ = l4
    check_engine(ref, model, config, tok)


def test_multimodal_checkpoint_loads_the_language_model(l4, tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (language_model.* prefixes, a vision tower)
    holding the same text weights gives the same logits; the vision weights are skipped."""
    ref = l4[3]
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    text = ref.hf.config.to_dict()
    mm_cfg = transformers.Llama4Config(text_config=text, vision_config=vision)
    mm = transformers.Llama4ForConditionalGeneration(mm_cfg)
    mm.language_model.load_state_dict(ref.hf.state_dict())
    mm.save_pretrained(tmp_path / "mm")
    with safe_open(tmp_path / "mm" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "language_model.model.embed_tokens.weight" in names
    assert any(n.startswith("vision_model.") for n in names)
    mm_model, mm_config, _ = load_model(tmp_path / "mm")
    assert isinstance(mm_model, Llama4ForCausalLM)
    assert mm_config["architectures"] == ["Llama4ForConditionalGeneration"]
    p = prompt(40, 9)
    _, first = PagedRunner(mm_model, mm_config).generate([p], 1)
    assert (first[0] - ref(p)[0]).abs().max().item() < TOL


def test_published_config_matches_planner_and_transformers():
    """Llama 4 Scout's config.json: layer kinds and chunk size as the planner and
    transformers read them, RoPE / NoPE layers, MoE layers and sizes, the llama3 RoPE."""
    config = REFERENCE_CONFIGS[SCOUT]
    assert model_class(config) is Llama4ForCausalLM
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).text_config
    with torch.device("meta"):
        model = Llama4ForCausalLM(config)
    specs = cache_spec_from_config(config, dtype="bfloat16").layers
    layers = model.model.layers
    assert len(layers) == len(specs) == ref_cfg.num_hidden_layers == 48
    assert ref_cfg.layer_types.count(FULL) == 12
    for i, (layer, kind) in enumerate(zip(layers, ref_cfg.layer_types, strict=True)):
        spec, attn = specs[f"model.layers.{i}"], layer.self_attn
        assert isinstance(spec, ChunkedLocalSpec) == (kind == CHUNKED)
        assert (
            attn.chunk
            == (ref_cfg.attention_chunk_size if kind == CHUNKED else None)
            == (spec.chunk_size if kind == CHUNKED else None)
        )
        assert attn.use_rope == bool(ref_cfg.no_rope_layers[i])
        assert (attn.qk_norm_eps is not None) == attn.use_rope  # use_qk_norm
        assert attn.temperature == (None if attn.use_rope else (8192.0, 0.1))
        assert (spec.num_kv_heads, spec.head_dim) == (8, 128)
        assert isinstance(layer.feed_forward, MoE) == (i in ref_cfg.moe_layers)
    attn = layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (40, 8, 128)
    moe = layers[0].feed_forward
    assert moe.experts.gate_up_proj.shape == (16, 2 * 8192, 5120)
    assert moe.shared_expert.gate_proj.weight.shape == (8192, 5120)
    assert moe.top_k == ref_cfg.num_experts_per_tok == 1
    s = llama4._Settings(config)
    inv, scale = inverse_frequencies(s.rope, s.head_dim)
    rope = modeling_llama4.Llama4TextRotaryEmbedding(ref_cfg)
    assert rope.rope_type == "llama3"
    torch.testing.assert_close(inv, rope.inv_freq, rtol=0, atol=0)
    assert scale == rope.attention_scaling == 1.0


def test_defaults_for_missing_fields():
    """A config without moe_layers / no_rope_layers / rope theta takes Llama4TextConfig's
    rules: every interleave_moe_layer_step-th layer, every no_rope_layer_interval-th NoPE."""
    text = copy.deepcopy(REFERENCE_CONFIGS[SCOUT]["text_config"])
    text.update(
        architectures=["Llama4ForCausalLM"],
        num_hidden_layers=8,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=3,
        rope_scaling=None,
    )
    for key in ("no_rope_layers", "rope_theta", "model_type"):
        text.pop(key)
    ref_cfg = transformers.Llama4TextConfig(**text)
    s = llama4._Settings(text)
    assert sorted(s.moe_layers) == ref_cfg.moe_layers == [1, 3, 5, 7]
    assert s.use_rope == [bool(f) for f in ref_cfg.no_rope_layers]
    assert s.rope.theta == ref_cfg.rope_parameters["rope_theta"] == 500000.0


def test_config_whose_head_geometry_the_planner_reads_differently_is_refused():
    """Without head_dim transformers takes 128, the planner hidden_size / heads: refused."""
    config = copy.deepcopy(REFERENCE_CONFIGS[SCOUT])
    config["text_config"].pop("head_dim")
    config["text_config"]["hidden_size"] = 2560  # 64 per head
    with pytest.raises(ValueError, match=r"head_dim 64 .* transformers 128"):
        llama4._Settings(config)
