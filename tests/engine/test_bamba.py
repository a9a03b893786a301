"""Bamba (Mamba2 + attention, partial RoPE) against transformers on the paged pool."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybrid_pd.engine.loader import load_model  # noqa: E402
from hybrid_pd.engine.models.bamba import BambaForCausalLM, _Settings  # noqa: E402
from hybrid_pd.engine.models.rope import inverse_frequencies  # noqa: E402
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS  # noqa: E402
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
def bamba(tmp_path_factory):
    path = checkpoints.bamba(tmp_path_factory.mktemp("bamba"))
    model, config, tok = load_model(path)
    return model, config, tok, Reference(path)


def test_parameters_are_transformers_own(bamba):
    model, _, _, ref = bamba
    assert isinstance(model, BambaForCausalLM)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == {n: tuple(p.shape) for n, p in ref.hf.named_parameters()}


def test_layer_kinds_and_partial_rope(bamba):
    model, _, _, ref = bamba
    kinds = ["attn" if layer.mamba is None else "mamba" for layer in model.model.layers]
    assert kinds == ["mamba", "attn", "mamba", "mamba"]
    attn = model.model.layers[1].self_attn
    assert (attn.head_dim, attn.rotary_dim) == (16, 8)
    torch.testing.assert_close(model.model.inv_freq, ref.hf.model.rotary_emb.inv_freq)


def test_one_token_and_long_prompt(bamba):
    # 300 tokens: about 19 Mamba2 chunks of 16
    model, config, _, ref = bamba
    prompts = [[7], prompt(300, 2)]
    check_runner(ref, PagedRunner(model, config), prompts)
    check_distinct(ref, [*prompts, prompt(40, 3)])


def test_batched_different_lengths(bamba):
    model, config, _, ref = bamba
    check_runner(ref, PagedRunner(model, config), [prompt(n, 10 + n) for n in (3, 17, 45, 130)])


@pytest.mark.parametrize("chunk", [7, 23])
def test_chunked_prefill_cuts_mamba_chunks(bamba, chunk):
    # chunks of 7 / 23 tokens: aligned neither to blocks (4) nor to Mamba2 chunks (16)
    model, config, _, ref = bamba
    check_runner(ref, PagedRunner(model, config), [prompt(150, 3), prompt(61, 4)], chunk=chunk)


def test_prefix_cache_hit_from_snapshot(bamba):
    model, config, _, ref = bamba
    check_prefix_snapshot(ref, model, config)


def test_prefix_cache_hit_after_finish(bamba):
    model, config, _, ref = bamba
    check_prefix_after_finish(ref, model, config)


def test_engine_batched_chunked_with_prefix_hits(bamba):
    model, config, tok, ref = bamba
    check_engine(ref, model, config, tok)


def test_tied_embeddings_and_one_group(tmp_path):
    path = checkpoints.bamba(
        tmp_path, name="tied", tie_word_embeddings=True, mamba_n_groups=1, attn_layer_indices=[2]
    )
    model, config, _ = load_model(path)
    assert model.lm_head is None
    check_runner(Reference(path), PagedRunner(model, config), [prompt(70, 11)], chunk=13)


def test_published_config_resolves_as_transformers():
    """Bamba-9B's config.json: attention layers, Mamba2 sizes and the half-head RoPE as
    transformers reads them."""
    config = REFERENCE_CONFIGS["ibm-ai-platform/Bamba-9B"]
    assert model_class(config) is BambaForCausalLM
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = BambaForCausalLM(config)
    kinds = [layer.mamba is None for layer in model.model.layers]
    assert kinds == [k == "full_attention" for k in ref_cfg.layers_block_type]
    mixer = model.model.layers[0].mamba
    assert (mixer.heads, mixer.head_dim, mixer.groups, mixer.state, mixer.chunk) == (
        ref_cfg.mamba_n_heads,
        ref_cfg.mamba_d_head,
        ref_cfg.mamba_n_groups,
        ref_cfg.mamba_d_state,
        ref_cfg.mamba_chunk_size,
    )
    s = _Settings(config)
    rope = transformers.models.bamba.modeling_bamba.BambaRotaryEmbedding(ref_cfg)
    inv, _ = inverse_frequencies(s.rope, s.rotary_dim)
    assert s.rotary_dim == 64
    torch.testing.assert_close(inv, rope.inv_freq, rtol=0, atol=0)
