"""Qwen3.5 (Gated DeltaNet + gated attention) on the paged pool vs transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)
from transformers import Qwen3_5ForCausalLM as HFQwen3_5ForCausalLM
from transformers import Qwen3_5MoeForCausalLM as HFQwen3_5MoeForCausalLM

from hybrid_pd.engine.models.gated_deltanet import (
    delta_rule_chunked,
    delta_rule_rows,
    delta_rule_step,
)
from hybrid_pd.engine.models.qwen3_5 import Qwen3_5ForCausalLM, tiny_qwen3_5_config
from tests.engine.harness import PagedRunner

VOCAB = 256
NEW = 32
TOL = 1e-4

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    max_position_embeddings=2048,
    initializer_range=0.2,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    dtype="float32",
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _save_and_load(hf, tmp_path):
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    ours = Qwen3_5ForCausalLM(config).eval()
    ours.load_weights(load_file(str(tmp_path / "model.safetensors")).items())
    return ours, config


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    torch.manual_seed(0)
    hf = HFQwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL)).eval()
    ours, config = _save_and_load(hf, tmp_path_factory.mktemp("qwen3_5"))
    return hf, ours, config


@torch.no_grad()
def _reference(hf, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    logits = hf(input_ids=ids).logits[0, -1].float()
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return logits, out[0, len(prompt) :].tolist()


def _prompt(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _check(hf, runner, prompts, chunk=None, refs=None):
    refs = refs or [_reference(hf, p) for p in prompts]
    tokens, first = runner.generate(prompts, NEW, chunk=chunk)
    diffs = []
    for (ref_logits, ref_tokens), got, logits in zip(refs, tokens, first, strict=True):
        diff = (logits - ref_logits).abs().max().item()
        diffs.append(diff)
        assert diff < TOL, diff
        assert len(set(ref_tokens)) >= 4, ref_tokens  # the comparison must prove something
        assert got == ref_tokens
    return refs, tokens, diffs


def test_delta_rule_rows_on_strided_rows_matches_the_one_sequence_step():
    """delta_rule_rows on states gathered as pool rows (a row stride wider than one state),
    updated in place, gives each sequence's delta_rule_step."""
    torch.manual_seed(1)
    s, h, dk, dv = 3, 4, 8, 5
    q = torch.nn.functional.normalize(torch.randn(s, h, dk), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(s, h, dk), dim=-1)
    v, g, beta = torch.randn(s, h, dv), -torch.rand(s, h), torch.rand(s, h)
    rows = torch.randn(s, h * dk * dv + 24)
    state = rows[:, 8 : 8 + h * dk * dv].unflatten(1, (h, dk, dv))
    want = [delta_rule_step(q[i], k[i], v[i], g[i], beta[i], state[i].clone()) for i in range(s)]
    before = rows.clone()
    out, new = delta_rule_rows(q, k, v, g, beta, state)
    assert new.data_ptr() == state.data_ptr()  # updated where it lies
    for i, (o, st) in enumerate(want):
        torch.testing.assert_close(out[i], o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new[i], st, rtol=1e-5, atol=1e-6)
    assert torch.equal(rows[:, :8], before[:, :8]) and torch.equal(rows[:, -16:], before[:, -16:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_convolution_and_its_decode_steps_give_the_same_bits(dtype):
    """On the CPU the delta rule's causal conv + SiLU runs in float32 in C in a prompt
    (`conv_silu`) and in a decode step (`conv_step_silu`), in every dtype: a token's output
    and the state it leaves are the same bits however its tokens came."""
    from hybrid_pd.engine.models.gated_deltanet import GatedDeltaNet

    gen = torch.Generator().manual_seed(3)
    layer = GatedDeltaNet({**SMALL, "linear_conv_kernel_dim": 4}, "model.layers.0").to(dtype)
    with torch.no_grad():
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen))
    c = layer.conv_dim
    x = torch.randn(6, c, generator=gen).to(dtype)
    state = torch.randn(c, 3, generator=gen).to(dtype)
    with torch.no_grad():
        out, new_state = layer._conv(x, state)
        rows = state.clone()[None]  # one sequence's conv state as a step's rows [1, C, K-1]
        steps = [
            layer._conv_step_kernel(rows, x[t : t + 1], layer.conv1d.weight[:, 0]) for t in range(6)
        ]
    assert all(s is not None for s in steps)
    assert out.dtype is torch.float32
    assert torch.equal(torch.cat(steps), out)
    assert torch.equal(rows[0], new_state.to(dtype))
    # and what the PyTorch convolution computes, within its roundings
    with torch.no_grad():
        seq = torch.cat([state, x.t()], dim=1).float()
        ref = torch.nn.functional.silu(
            torch.nn.functional.conv1d(seq[None], layer.conv1d.weight.float(), groups=c)[0]
        ).t()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_delta_rule_chunked_matches_recurrent():
    torch.manual_seed(0)
    h, n, dk, dv = 3, 150, 8, 5
    q = torch.nn.functional.normalize(torch.randn(h, n, dk), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(h, n, dk), dim=-1)
    v = torch.randn(h, n, dv)
    beta, state0 = torch.rand(h, n), torch.randn(h, dk, dv)
    # mild decays, and strong ones whose products over a block underflow (exp gives 0)
    for g in (-torch.rand(h, n), -30 * torch.rand(h, n)):
        state, outs = state0, []
        for t in range(n):
            o, state = delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            outs.append(o)
        ref = torch.stack(outs, dim=1)
        for chunk in (64, 7):
            out, final = delta_rule_chunked(q, k, v, g, beta, state0, chunk=chunk)
            assert (out - ref).abs().max() < 1e-4
            assert (final - state).abs().max() < 1e-4


def test_one_token_prompt(small):
    hf, ours, config = small
    _check(hf, PagedRunner(ours, config), [[7]])


def test_long_prompt_several_gdn_chunks(small):
    hf, ours, config = small
    _check(hf, PagedRunner(ours, config), [_prompt(1, 300)])


def test_batched_different_lengths(small):
    hf, ours, config = small
    prompts = [_prompt(2, 5), _prompt(3, 160), _prompt(4, 1), _prompt(5, 70)]
    _check(hf, PagedRunner(ours, config), prompts)


@pytest.mark.parametrize("chunk", [37, 100])
def test_chunked_prefill_cuts_gdn_chunks(small, chunk):
    """Prefill steps of 37 / 100 tokens: GDN chunks of 64 and blocks of 4 cut mid-way."""
    hf, ours, config = small
    prompts = [_prompt(6, 203), _prompt(7, 158)]
    refs, whole, _ = _check(hf, PagedRunner(ours, config), prompts)
    _, split, _ = _check(hf, PagedRunner(ours, config), prompts, chunk=chunk, refs=refs)
    assert split == whole  # decode after a chunked prefill == decode after one pass


def test_prefix_cache_hit(small):
    """GDN states are cached as snapshots on block boundaries: a follow-up turn that extends
    a finished request (181 + 31 = 212 computed tokens, a multiple of 4) and a prompt whose
    first 120 tokens were snapshotted mid-prefill both start from the cached state."""
    hf, ours, config = small
    runner = PagedRunner(ours, config)
    base = _prompt(8, 181)
    _, (gen,), _ = _check(hf, runner, [base], chunk=64)
    follow = [*base, *gen[:31], *_prompt(9, 40)]
    assert runner.mgr.find_prefix_hit(follow).num_tokens == 212
    _check(hf, runner, [follow])
    other = _prompt(10, 150)
    runner.step([("warm", other[:120], other[:120])])
    assert runner.mgr.snapshot_states("warm")
    runner.mgr.free("warm")
    assert runner.mgr.find_prefix_hit(other).num_tokens == 120
    _check(hf, runner, [other])


def test_conditional_generation_checkpoint(tmp_path):
    """Multimodal layout: text under text_config, weights under model.language_model."""
    torch.manual_seed(1)
    text = {k: v for k, v in SMALL.items() if k != "dtype"}
    text["tie_word_embeddings"] = True
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    ours, config = _save_and_load(hf, tmp_path)
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)  # present, ignored
    _check(hf, PagedRunner(ours, config), [_prompt(10, 90), _prompt(11, 3)], chunk=29)


def test_tiny_default_config(tmp_path):
    torch.manual_seed(2)
    tiny = tiny_qwen3_5_config()
    fields = {k: v for k, v in tiny.items() if k not in ("architectures", "model_type")}
    fields["initializer_range"] = 0.2
    hf = HFQwen3_5ForCausalLM(Qwen3_5TextConfig(**fields)).eval()
    ours, config = _save_and_load(hf, tmp_path)
    assert config["architectures"] == tiny["architectures"]
    prompt = list(b"hello, qwen3.5 hybrid world!")
    _, _, diffs = _check(hf, PagedRunner(ours, config), [prompt, _prompt(12, 140, 512)])
    assert max(diffs) < TOL


def test_moe_variant(tmp_path):
    """Qwen3.5-MoE: per-expert checkpoint tensors (save_pretrained) and stacked in-memory
    ones (experts.gate_up_proj / down_proj) load to the same model and match transformers."""
    torch.manual_seed(3)
    moe = dict(
        SMALL,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    hf = HFQwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**moe)).eval()
    ours, config = _save_and_load(hf, tmp_path)
    assert any(".mlp.experts.0.gate_proj." in n for n in load_file(tmp_path / "model.safetensors"))
    stacked = Qwen3_5ForCausalLM(config).eval()
    stacked.load_weights(hf.state_dict().items())
    for a, b in zip(ours.state_dict().values(), stacked.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    prompts = [_prompt(13, 170), _prompt(14, 9)]
    refs, _, _ = _check(hf, PagedRunner(ours, config), prompts)
    _check(hf, PagedRunner(ours, config), prompts, chunk=45, refs=refs)
