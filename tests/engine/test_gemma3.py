"""Gemma 3 text model on the paged cache vs transformers (logits and greedy tokens)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers as hft

from hybrid_pd.engine.models.gemma3 import Gemma3ForCausalLM, _inv_freq, _Settings
from tests.engine.harness import PagedRunner

WINDOW = 16
VOCAB = 160
NEW = 32
TOL = 1e-4


def _text_kwargs(**over) -> dict:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=WINDOW,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
        },
        query_pre_attn_scalar=24,
        final_logit_softcapping=20.0,
        # Stored but not applied by transformers' Gemma 3; ours must ignore it too.
        attn_logit_softcapping=3.0,
        initializer_range=0.05,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=2,
    )
    kw.update(over)
    return kw


def _randomize_norms(model: torch.nn.Module) -> None:
    """(1 + w) norms start at w = 0: give them weights so the offset is exercised."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 2.0)


def _save_and_load(hf, tmp_path) -> tuple[Gemma3ForCausalLM, dict]:
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    ours = Gemma3ForCausalLM(config)
    ours.load_weights(safetensors.torch.load_file(tmp_path / "model.safetensors").items())
    return ours.eval(), config


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = hft.Gemma3ForCausalLM(hft.Gemma3TextConfig(**_text_kwargs())).eval()
    _randomize_norms(hf)
    hf.generation_config.eos_token_id = None
    ours, config = _save_and_load(hf, tmp_path_factory.mktemp("gemma3_text"))
    return hf, ours, config


@torch.no_grad()
def _reference(hf, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    logits = hf(input_ids=ids).logits[0, -1].float()
    out = hf.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return logits, out[0, len(prompt) :].tolist()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _check(hf, runner, prompts, chunk=None) -> list[float]:
    tokens, first = runner.generate(prompts, NEW, chunk=chunk)
    diffs = []
    for p, toks, logits in zip(prompts, tokens, first, strict=True):
        ref_logits, ref_toks = _reference(hf, p)
        diff = (logits - ref_logits).abs().max().item()
        diffs.append(diff)
        assert diff < TOL, f"len {len(p)}: max logit diff {diff}"
        assert len(set(ref_toks)) >= 4, "reference output too repetitive to prove anything"
        assert toks == ref_toks, f"len {len(p)}: greedy tokens differ"
    return diffs


def test_window_semantics_and_layer_types(text_pair):
    _, ours, _ = text_pair
    windows = [layer.self_attn.window for layer in ours.model.layers]
    assert windows == [WINDOW, WINDOW, None, WINDOW, None]
    assert abs(ours.model.layers[0].self_attn.scale - 24**-0.5) < 1e-12


def test_single_token_prompt(text_pair):
    hf, ours, config = text_pair
    _check(hf, PagedRunner(ours, config), [[7]])


def test_long_prompt_past_window(text_pair):
    hf, ours, config = text_pair
    # 300-token prompt with a 16-token window; decoding runs further past the window.
    _check(hf, PagedRunner(ours, config), [_prompt(300, 1)])


def test_batched_different_lengths(text_pair):
    hf, ours, config = text_pair
    prompts = [_prompt(n, 10 + n) for n in (3, 15, 17, 42, 130)]
    _check(hf, PagedRunner(ours, config), prompts)


@pytest.mark.parametrize("chunk", [5, 23])  # smaller / larger than the window, not block-aligned
def test_chunked_prefill(text_pair, chunk):
    hf, ours, config = text_pair
    prompts = [_prompt(n, 20 + n) for n in (9, 61, 117)]
    _check(hf, PagedRunner(ours, config), prompts, chunk=chunk)


def test_prefix_cache_hit_with_null_sliding_blocks(text_pair):
    hf, ours, config = text_pair
    runner = PagedRunner(ours, config)
    shared = _prompt(120, 30)
    first, second = shared + _prompt(9, 31), shared + _prompt(14, 32)
    _check(hf, runner, [first])
    hit = runner.mgr.find_prefix_hit(second)
    assert hit.num_tokens >= 100
    sliding = runner.config.group_of("model.layers.0").group_id
    full = runner.config.group_of("model.layers.2").group_id
    assert sliding != full
    assert any(b.is_null for b in hit.blocks[sliding]), "out-of-window blocks should be null"
    assert not any(b.is_null for b in hit.blocks[full])
    _check(hf, runner, [second])
    # The very same prompt again: every whole block before the last token is a hit.
    assert runner.mgr.find_prefix_hit(first).num_tokens == 128
    _check(hf, runner, [first])


def test_legacy_config_fields(text_pair):
    """Old-style rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern."""
    _, ours, config = text_pair
    legacy = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(
        rope_theta=5000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=3,
    )
    other = Gemma3ForCausalLM(legacy)
    assert [layer.kind for layer in other.model.layers] == [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    for kind in ("sliding_attention", "full_attention"):
        a = getattr(other.model, f"{kind}_inv_freq")
        b = getattr(ours.model, f"{kind}_inv_freq")
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_multimodal_checkpoint_text_part(tmp_path):
    torch.manual_seed(1)
    text = _text_kwargs(
        num_hidden_layers=4,
        layer_types=None,
        sliding_window_pattern=2,
        rope_parameters=None,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    text = {k: v for k, v in text.items() if v is not None}
    vision = hft.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = hft.Gemma3Config(
        text_config=text,
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        tie_word_embeddings=False,  # exercise the separate lm_head weight
    )
    hf = hft.Gemma3ForConditionalGeneration(cfg).eval()
    _randomize_norms(hf.model.language_model)
    hf.generation_config.eos_token_id = None
    ours, config = _save_and_load(hf, tmp_path)
    assert "text_config" in config
    # save_pretrained writes the original layout (language_model.model.*, vision_tower.*).
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert any(n.startswith("language_model.model.") for n in saved)
    assert any("vision_tower" in n for n in saved)
    _check(hf, PagedRunner(ours, config), [_prompt(70, 40), _prompt(11, 41)], chunk=13)
    # The in-memory layout (model.language_model.*, model.vision_tower.*, lm_head) loads too.
    state = hf.state_dict()
    assert any(n.startswith("model.language_model.") for n in state)
    other = Gemma3ForCausalLM(config)
    other.load_weights(state.items())
    for (name, a), b in zip(ours.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_real_multimodal_config_defaults():
    """gemma-3-4b-it's text_config leaves heads, head_dim, vocab and rope theta to the
    Gemma3TextConfig defaults; ours must resolve them as transformers does."""
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
    }
    ref = hft.Gemma3Config(**json.loads(json.dumps(config))).text_config
    with torch.device("meta"):
        ours = Gemma3ForCausalLM(config)
    assert [layer.kind for layer in ours.model.layers] == ref.layer_types
    attn = ours.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.window) == (
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
        ref.sliding_window,
    )
    assert attn.scale == ref.query_pre_attn_scalar**-0.5
    assert ours.model.embed_tokens.weight.shape == (ref.vocab_size, ref.hidden_size)
    rope = hft.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(ref)
    for kind in ("sliding_attention", "full_attention"):
        ours_inv = _inv_freq(_Settings(config).rope(kind), ref.head_dim)
        torch.testing.assert_close(ours_inv, getattr(rope, f"{kind}_inv_freq"), rtol=0, atol=0)
