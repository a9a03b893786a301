"""Nemotron-H (Mamba2 / attention / MLP blocks) against transformers on the paged pool."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybrid_pd.engine.loader import iter_safetensors, load_model  # noqa: E402
from hybrid_pd.engine.models.nemotron_h import NemotronHForCausalLM  # noqa: E402
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config  # noqa: E402
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
def nemotron(tmp_path_factory):
    path = checkpoints.nemotron_h(tmp_path_factory.mktemp("nemotron_h"))
    model, config, tok = load_model(path)
    return model, config, tok, Reference(path), path


def test_parameters_are_transformers_own(nemotron):
    model, _, _, ref, _ = nemotron
    assert isinstance(model, NemotronHForCausalLM)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == {n: tuple(p.shape) for n, p in ref.hf.named_parameters()}


def test_blocks_follow_the_pattern_and_the_cache_spec(nemotron):
    model, config, _, _, path = nemotron
    assert [layer.kind for layer in model.model.layers] == [
        "linear_attention",
        "mlp",
        "full_attention",
        "linear_attention",
        "mlp",
    ]
    spec = cache_spec_from_config(str(path))
    assert sorted(spec.layers) == ["model.layers.0", "model.layers.2", "model.layers.3"]
    # the SSM state keeps float32 (mamba_ssm_cache_dtype), the conv state the model dtype
    assert spec.layers["model.layers.0"].dtypes == ("float32", "float32")
    bf16 = cache_spec_from_config({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"})
    assert bf16.layers["model.layers.0"].dtypes == ("bfloat16", "float32")
    mixer = model.model.layers[0].mixer
    # time_step_min only initialises dt_bias: the clamp is time_step_limit (none here)
    assert (mixer.inner, mixer.dt_limit) == (8 * 24, (0.0, float("inf")))


def test_time_step_limit_names(nemotron):
    base = {**nemotron[1], "time_step_min": 0.3}
    limit = NemotronHForCausalLM({**base, "time_step_limit": [0.2, 5.0]}).model.layers[0].mixer
    assert limit.dt_limit == (0.2, 5.0)
    legacy = {**base, "time_step_limit": [0.2, 5.0], "mamba_dt_limit": [0.1, "Infinity"]}
    assert NemotronHForCausalLM(legacy).model.layers[0].mixer.dt_limit == (0.1, float("inf"))
    assert NemotronHForCausalLM(base).model.layers[0].mixer.dt_limit == (0.0, float("inf"))


def test_one_token_and_long_prompt(nemotron):
    # 300 tokens: about 19 Mamba2 chunks of 16
    model, config, _, ref, _ = nemotron
    prompts = [[7], prompt(300, 2)]
    check_runner(ref, PagedRunner(model, config), prompts)
    check_distinct(ref, [*prompts, prompt(40, 3)])


def test_batched_different_lengths(nemotron):
    model, config, _, ref, _ = nemotron
    check_runner(ref, PagedRunner(model, config), [prompt(n, 10 + n) for n in (3, 17, 45, 130)])


@pytest.mark.parametrize("chunk", [7, 23])
def test_chunked_prefill_cuts_mamba_chunks(nemotron, chunk):
    # chunks of 7 / 23 tokens: aligned neither to blocks (4) nor to Mamba2 chunks (16)
    model, config, _, ref, _ = nemotron
    check_runner(ref, PagedRunner(model, config), [prompt(150, 3), prompt(61, 4)], chunk=chunk)


def test_prefix_cache_hit_from_snapshot(nemotron):
    model, config, _, ref, _ = nemotron
    check_prefix_snapshot(ref, model, config)


def test_prefix_cache_hit_after_finish(nemotron):
    model, config, _, ref, _ = nemotron
    check_prefix_after_finish(ref, model, config)


def test_engine_batched_chunked_with_prefix_hits(nemotron):
    model, config, tok, ref, _ = nemotron
    check_engine(ref, model, config, tok)


@torch.no_grad()
def test_time_step_floor_against_full_forward(tmp_path):
    """With a time-step floor that bites, transformers' own decode path skips the clamp, so
    compare against its forward over the whole sequence (the chunked path, which applies it)."""
    # the same floor by either name: transformers before 5.25 clamped at time_step_min
    path = checkpoints.nemotron_h(
        tmp_path, name="floor", time_step_min=0.5, time_step_limit=(0.5, float("inf"))
    )
    model, config, _ = load_model(path)
    ref = Reference(path)
    p = prompt(50, 9)
    runner = PagedRunner(model, config)
    tokens, _ = runner.generate([p], 12, chunk=11)
    seq = p + tokens[0]
    logits = ref.hf(torch.tensor([seq])).logits[0]
    assert tokens[0] == logits[len(p) - 1 : -1].argmax(-1).tolist()
    # and the recurrent form with the clamp gives the chunked form's logits
    _, step_logits = PagedRunner(model, config).generate([p], 1, chunk=1)
    assert (step_logits[0] - logits[len(p) - 1]).abs().max().item() < 1e-4


def test_model_prefix_and_mtp_weights(nemotron):
    """Checkpoints (NVIDIA's, and transformers' own save) name the trunk ``backbone.``;
    transformers' in-memory ``model.`` names load too; MTP weights are skipped."""
    model, config, _, _, path = nemotron
    saved = list(iter_safetensors(path))
    assert all(k.startswith(("backbone.", "lm_head.")) for k, _ in saved)
    weights = [(k.replace("backbone.", "model.", 1), t) for k, t in saved]
    weights.append(("mtp.layers.0.norm.weight", torch.ones(3)))
    fresh = NemotronHForCausalLM(config)
    fresh.load_weights(weights)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_published_config_resolves_as_transformers():
    """Nemotron-H-8B's config.json (pattern string): block kinds and Mamba2 sizes as
    transformers reads them."""
    config = REFERENCE_CONFIGS["nvidia/Nemotron-H-8B-Base-8K"]
    assert model_class(config) is NemotronHForCausalLM
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = NemotronHForCausalLM(config)
    assert [layer.kind for layer in model.model.layers] == ref_cfg.layers_block_type
    first = model.model.layers[0].mixer
    assert (first.heads, first.head_dim, first.groups, first.state, first.chunk) == (
        ref_cfg.mamba_num_heads,
        ref_cfg.mamba_head_dim,
        ref_cfg.n_groups,
        ref_cfg.ssm_state_size,
        ref_cfg.chunk_size,
    )
    attn = next(la.mixer for la in model.model.layers if la.kind == "full_attention")
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary_dim) == (
        32,
        8,
        ref_cfg.head_dim,
        0,
    )


def test_moe_blocks(tmp_path):
    """Nemotron 3 style MoE blocks: grouped sigmoid routing with a correction bias, scaled
    weights, a latent projection around the experts, a shared expert."""
    path = checkpoints.nemotron_h(
        tmp_path,
        name="moe",
        hybrid_override_pattern="ME*EM",
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_latent_size=40,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    model, config, _ = load_model(path)
    ref = Reference(path)
    assert [layer.kind for layer in model.model.layers].count("moe") == 2
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == {n: tuple(p.shape) for n, p in ref.hf.named_parameters()}
    check_runner(ref, PagedRunner(model, config), [prompt(3, 20), prompt(90, 21)], chunk=13)
    # saved as NVIDIA lays it out ('...experts.{e}.up_proj.weight'); transformers' in-memory
    # 3-d layout ('...experts.up_proj' [E, I, D]) loads too
    saved = dict(iter_safetensors(path))
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in saved
    merged, stacks = [], {}
    for key, t in saved.items():
        head, sep, tail = key.partition(".experts.")
        if sep:
            expert, proj, _ = tail.split(".")
            stacks.setdefault(f"{head}.experts.{proj}", {})[int(expert)] = t
        else:
            merged.append((key, t))
    merged += [(k, torch.stack([v[e] for e in sorted(v)])) for k, v in stacks.items()]
    fresh = NemotronHForCausalLM(config)
    fresh.load_weights(merged)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name
