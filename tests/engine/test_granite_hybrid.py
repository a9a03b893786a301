"""Granite-4.0-H (GraniteMoeHybrid) against transformers on the paged pool."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hybrid_pd.engine.models.granite_hybrid import GraniteMoeHybridForCausalLM  # noqa: E402
from tests.engine.harness import PagedRunner  # noqa: E402

VOCAB = 160
NEW = 32

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=8,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    embedding_multiplier=2.0,
    attention_multiplier=0.12,
    residual_multiplier=0.6,
    logits_scaling=2.5,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# MoE + shared MLP, RoPE, B/C in 2 groups, attention between Mamba2 layers.
MOE = dict(
    BASE,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=32,
    shared_intermediate_size=48,
    mamba_n_groups=2,
    position_embedding_type="rope",
)
# Dense (no experts), no position embedding, 1 group, tied embeddings, legacy layer names.
DENSE = dict(
    BASE,
    num_hidden_layers=3,
    layer_types=["mamba", "mamba", "attention"],
    num_local_experts=0,
    shared_intermediate_size=96,
    mamba_n_groups=1,
    position_embedding_type="nope",
    tie_word_embeddings=True,
)


def _build(tmp_path, kwargs):
    torch.manual_seed(0)
    cfg = transformers.GraniteMoeHybridConfig(**kwargs)
    ref = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    with torch.no_grad():  # spread A and dt so the heads decay at different rates
        for layer in ref.model.layers:
            if layer.mamba is not None:
                layer.mamba.A_log.uniform_(-1.0, 1.0)
                layer.mamba.dt_bias.uniform_(-2.0, 0.5)
                layer.mamba.D.normal_()
    path = str(tmp_path / "ckpt")
    ref.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    ours = GraniteMoeHybridForCausalLM(config).eval()
    ours.load_weights(safetensors_torch.load_file(os.path.join(path, "model.safetensors")).items())
    return ref, ours, config


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("moe"), MOE)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("dense"), DENSE)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@torch.no_grad()
def _reference(ref, prompt):
    ids = torch.tensor([prompt])
    logits = ref(ids).logits[0, -1]
    mask = torch.ones_like(ids)
    out = ref.generate(ids, max_new_tokens=NEW, do_sample=False, attention_mask=mask)
    return logits, out[0, len(prompt) :].tolist()


def _check(ref, runner, prompts, chunk=None):
    tokens, first = runner.generate(prompts, NEW, chunk=chunk)
    worst = 0.0
    for p, toks, logits in zip(prompts, tokens, first, strict=True):
        want_logits, want = _reference(ref, p)
        diff = (logits - want_logits).abs().max().item()
        worst = max(worst, diff)
        assert diff < 1e-4, f"prompt of {len(p)}: logits differ by {diff}"
        assert len(set(want)) >= 4, f"reference output too repetitive: {want}"
        assert toks == want, f"prompt of {len(p)}:\n ours {toks}\n want {want}"
    return worst


def test_one_token_prompt(moe, dense):
    for ref, ours, config in (moe, dense):
        _check(ref, PagedRunner(ours, config), [_prompt(1, 1)])


def test_long_prompt_many_ssd_chunks(moe, dense):
    # 300 tokens: about 19 Mamba2 chunks of 16
    for ref, ours, config in (moe, dense):
        _check(ref, PagedRunner(ours, config), [_prompt(300, 2)])


def test_batched_different_lengths(moe):
    ref, ours, config = moe
    _check(ref, PagedRunner(ours, config), [_prompt(n, 10 + n) for n in (3, 17, 45, 130)])


@pytest.mark.parametrize("chunk", [7, 23])
def test_chunked_prefill_cuts_ssd_chunks(moe, chunk):
    # chunks of 7 / 23 tokens: neither aligned to blocks (4) nor to SSD chunks (16)
    ref, ours, config = moe
    _check(ref, PagedRunner(ours, config), [_prompt(150, 3), _prompt(61, 4)], chunk=chunk)


def test_chunked_prefill_dense(dense):
    ref, ours, config = dense
    _check(ref, PagedRunner(ours, config), [_prompt(110, 5)], chunk=13)


def test_prefix_cache_hit_after_finish(moe):
    """A finished request leaves a state snapshot when it ends on a block boundary; a
    follow-up turn (its prompt + answer + new tokens) starts from that snapshot."""
    ref, ours, config = moe
    runner = PagedRunner(ours, config)
    bs = runner.config.block_size
    n = 90 - (90 + NEW - 1) % bs  # computed tokens at the end: a whole number of blocks
    prompt = _prompt(n, 6)
    tokens, _ = runner.generate([prompt], NEW)
    follow = prompt + tokens[0][: NEW - 1] + _prompt(21, 7)
    assert runner.mgr.find_prefix_hit(follow).num_tokens == n + NEW - 1
    _check(ref, runner, [follow])
    assert runner.mgr.find_prefix_hit(follow[:100] + _prompt(9, 8)).num_tokens == 0


def test_prefix_cache_hit_from_snapshot(moe):
    """Snapshot the states mid-prefill (64 tokens, 4 SSD chunks), then the same prompt and a
    prompt sharing those 64 tokens start from it, one of them with chunked prefill."""
    ref, ours, config = moe
    runner = PagedRunner(ours, config)
    prompt = _prompt(100, 9)
    runner.step([("warm", prompt[:64], prompt[:64])])
    assert runner.mgr.snapshot_states("warm")
    runner.mgr.free("warm")
    assert runner.mgr.find_prefix_hit(prompt).num_tokens == 64
    _check(ref, runner, [prompt])
    other = prompt[:64] + _prompt(37, 10)
    assert runner.mgr.find_prefix_hit(other).num_tokens == 64
    _check(ref, runner, [other], chunk=9)


@torch.no_grad()
def test_chunked_form_matches_recurrent_form(moe):
    """Token-by-token prefill (recurrent form) against the one-pass SSD over the prompt."""
    _, ours, config = moe
    prompt = _prompt(40, 8)
    _, one_step = PagedRunner(ours, config).generate([prompt], 1, chunk=1)
    _, one_pass = PagedRunner(ours, config).generate([prompt], 1)
    assert (one_step[0] - one_pass[0]).abs().max().item() < 1e-4


@torch.no_grad()
def test_time_step_limit_against_full_forward(tmp_path):
    """With a time-step limit transformers' own decode path skips the clamp, so compare
    against its forward over the whole sequence (the chunked path, which applies it)."""
    kwargs = dict(MOE, time_step_limit=(0.05, 0.4))
    ref, ours, config = _build(tmp_path, kwargs)
    prompt = _prompt(50, 9)
    runner = PagedRunner(ours, config)
    tokens, _ = runner.generate([prompt], 12, chunk=11)
    seq = prompt + tokens[0]
    logits = ref(torch.tensor([seq])).logits[0]
    want = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert tokens[0] == want
    # and the recurrent form with the clamp gives the same logits as the chunked form
    _, step_logits = PagedRunner(ours, config).generate([prompt], 1, chunk=1)
    assert (step_logits[0] - logits[len(prompt) - 1]).abs().max().item() < 1e-4


@torch.no_grad()
def test_one_token_moe_path_equals_the_routed_path_bit_for_bit(monkeypatch):
    """A batch-1 decode step's MoE skips the routing's sort and token indexing; it must add
    the same expert outputs in the same order as the general path (with three experts per
    token the order changes the sum's rounding)."""
    from types import SimpleNamespace

    from hybrid_pd.engine.models import common, granite_hybrid

    torch.manual_seed(0)
    settings = SimpleNamespace(n_experts=6, top_k=3, hidden=64, expert_inter=32, act="silu")
    block = granite_hybrid.SparseMoE(settings)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    xs = [torch.randn(1, 64) for _ in range(40)]
    fast = [block(x) for x in xs]
    monkeypatch.setattr(granite_hybrid, "add_routed", common._add_by_expert)
    for x, got in zip(xs, fast, strict=True):
        assert torch.equal(got, block(x))


@torch.no_grad()
@pytest.mark.parametrize("tokens", [4, 9, 32])
def test_all_experts_path_matches_each_token_through_its_own_experts(monkeypatch, tokens):
    """A decode batch whose tokens pick every expert runs all experts as two GEMMs; its
    output is each token's weighted experts summed, up to float rounding."""
    from types import SimpleNamespace

    from hybrid_pd.engine.models import granite_hybrid

    def routed(*args):
        raise AssertionError("took the routed path")

    torch.manual_seed(tokens)
    settings = SimpleNamespace(n_experts=4, top_k=2, hidden=64, expert_inter=32, act="silu")
    block = granite_hybrid.SparseMoE(settings)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(tokens, 64)
    top_logits, top_idx = block.router.layer(x).float().topk(2, dim=-1)
    assert top_idx.unique().numel() == 4  # the case under test: every expert picked
    monkeypatch.setattr(granite_hybrid, "add_routed", routed)
    got = block(x)
    top_w = torch.softmax(top_logits, dim=-1)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for slot in range(2):
            want[t] += block._expert(int(top_idx[t, slot]), x[t : t + 1])[0] * top_w[t, slot]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_batch_that_leaves_an_expert_out_is_routed(monkeypatch):
    """Running all experts would read weights no token needs: such a batch is routed."""
    from types import SimpleNamespace

    from hybrid_pd.engine.models import granite_hybrid

    settings = SimpleNamespace(n_experts=4, top_k=2, hidden=64, expert_inter=32, act="silu")
    block = granite_hybrid.SparseMoE(settings)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    block.router.layer.weight.zero_()  # equal logits: every token picks experts 0 and 1
    x = torch.randn(6, 64)
    called = []
    real = granite_hybrid.add_routed
    monkeypatch.setattr(granite_hybrid, "add_routed", lambda *a: called.append(1) or real(*a))
    block(x)
    assert called
