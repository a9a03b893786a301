"""The dense Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) against transformers.

Each family's checkpoint (tests/checkpoints.py) is loaded through our loader and through
transformers; the engine's greedy tokens (batched, chunked prefill, prefix-cache hits) must
equal transformers' `generate`, and the first-step logits agree within TOL (float32).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybrid_pd.engine.engine import Engine, EngineConfig  # noqa: E402
from hybrid_pd.engine.loader import load_model  # noqa: E402
from hybrid_pd.engine.models.llama import DenseForCausalLM  # noqa: E402
from hybrid_pd.engine.models.rope import inverse_frequencies, rope_settings  # noqa: E402
from hybrid_pd.engine.registry import model_class  # noqa: E402
from hybrid_pd.engine.sampling import SamplingParams  # noqa: E402
from hybrid_pd.kvcache.reference_configs import REFERENCE_CONFIGS  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.engine.harness import PagedRunner  # noqa: E402

FAMILIES = {
    "llama": checkpoints.llama,
    "mistral": checkpoints.mistral,
    "qwen2": checkpoints.qwen2,
    "qwen3": checkpoints.qwen3,
}
NEW = 24
TOL = 1e-4
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


class Reference:
    """transformers on the same checkpoint folder: greedy tokens and last-position logits."""

    def __init__(self, path) -> None:
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.hf.eval()
        self.hf.generation_config.eos_token_id = None  # never stop early, like ignore_eos
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}

    @torch.no_grad()
    def __call__(self, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
        key = tuple(prompt)
        if key not in self._memo:
            ids = torch.tensor([prompt])
            logits = self.hf(input_ids=ids).logits[0, -1].float()
            out = self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
            )
            self._memo[key] = logits, out[0, len(prompt) :].tolist()
        return self._memo[key]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    return request.param, load_model(path), Reference(path)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _check_runner(ref: Reference, model, config, prompts, chunk: int | None) -> float:
    """Paged greedy run vs transformers; returns the largest first-step logit difference."""
    tokens, first = PagedRunner(model, config).generate(prompts, NEW, chunk=chunk)
    worst = 0.0
    continuations = set()
    for p, toks, logits in zip(prompts, tokens, first, strict=True):
        want_logits, want = ref(p)
        worst = max(worst, (logits - want_logits).abs().max().item())
        assert len(set(want)) >= 4, "reference output too repetitive to prove anything"
        assert toks == want, f"prompt of {len(p)} tokens: greedy tokens differ"
        continuations.add(tuple(want))
    assert len(continuations) == len(prompts), "different prompts should continue differently"
    assert worst < TOL, f"max logit diff {worst}"
    return worst


def _assert_clean(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_requests == 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 1


def test_parameters_are_transformers_own(family):
    """Same parameter names and shapes as the transformers model (a tied head aside)."""
    _, (model, config, _), ref = family
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in ref.hf.named_parameters()}
    if config.get("tie_word_embeddings"):
        assert model.lm_head is None
        theirs.pop("lm_head.weight", None)
    assert ours == theirs


def test_layer_kinds_follow_the_config(family):
    name, (model, config, _), _ = family
    windows = [layer.self_attn.window for layer in model.model.layers]
    if name == "mistral":
        assert windows == [checkpoints.SW_WINDOW] * config["num_hidden_layers"]
    else:
        assert set(windows) == {None}
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == config.get("head_dim", config["hidden_size"] // 4)
    assert (attn.q_norm is not None) == (name == "qwen3")
    assert (attn.q_proj.bias is not None) == (name in ("llama", "qwen2"))
    assert (attn.o_proj.bias is not None) == (name == "llama")


def test_logits_and_tokens_with_chunked_prefill(family):
    _, (model, config, _), ref = family
    prompts = [[7], _prompt(9, 1), _prompt(40, 2), _prompt(150, 3)]
    _check_runner(ref, model, config, prompts, chunk=7)


def test_engine_batched_chunked_with_prefix_hits(family):
    _, (model, config, tok), ref = family
    engine = Engine(
        model, config, EngineConfig(kv_memory_bytes=4 * 2**20, max_num_batched_tokens=19), tok
    )
    shared = _prompt(70, 4)
    prompts = [_prompt(5, 5), [*shared, 1, 2], _prompt(33, 6), _prompt(130, 7)]
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [ref(p)[1] for p in prompts]
    assert len({tuple(o.token_ids) for o in outs}) == len(prompts)
    again = [[*shared, 1, 2], [*shared, 9, 9, 9]]
    outs = engine.generate(again, GREEDY)
    assert all(o.num_cached_tokens >= 48 for o in outs), [o.num_cached_tokens for o in outs]
    assert [o.token_ids for o in outs] == [ref(p)[1] for p in again]
    _assert_clean(engine)


# --------------------------------------------------------------------------- other configs


def _rewrite(path, drop=(), **fields) -> dict:
    """Edit a saved config.json in place (legacy layouts of published checkpoints)."""
    config = json.loads((path / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return config


VARIANTS = {
    # Llama 2 style: legacy rope_theta + rope_scaling with "type", tied head, head_dim given
    # and not hidden / heads, no biases.
    "llama_legacy_linear_tied": (
        checkpoints.llama,
        dict(tie_word_embeddings=True, attention_bias=False, mlp_bias=False, head_dim=24),
        dict(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0}),
    ),
    # Published Qwen2.5 layout (no layer_types): sliding window from max_window_layers on.
    "qwen2_sliding_layers": (
        checkpoints.qwen2,
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
        dict(),
    ),
    # Qwen3 with biases and the legacy yarn form its model cards recommend.
    "qwen3_bias_legacy_yarn": (
        checkpoints.qwen3,
        dict(attention_bias=True),
        dict(
            rope_theta=1_000_000.0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            max_position_embeddings=256,
        ),
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants(variant, tmp_path):
    build, overrides, legacy = VARIANTS[variant]
    path = build(tmp_path, name=variant, **overrides)
    drop = ("rope_parameters",) if legacy else ()
    if variant == "qwen2_sliding_layers":
        drop = ("layer_types",)
    config = _rewrite(path, drop, **legacy)
    model, loaded_config, _ = load_model(path)
    assert loaded_config == config
    windows = [layer.self_attn.window for layer in model.model.layers]
    if variant == "qwen2_sliding_layers":
        assert windows == [None, 16]
    _check_runner(Reference(path), model, config, [_prompt(6, 12), _prompt(100, 13)], chunk=13)


# --------------------------------------------------------------------------- RoPE and refusals

_ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3.1": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    },
    "yarn_mscale_untruncated": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


@pytest.mark.parametrize("name", sorted(_ROPES))
def test_rope_frequencies_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _ROPES[name]
    cfg = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters=copy.deepcopy(params),
    )
    kind = params["rope_type"]
    if kind == "default":
        want, want_scale = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
            cfg
        ).compute_default_rope_parameters(cfg)
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    config = {"max_position_embeddings": 131072, "rope_parameters": params}
    inv, scale = inverse_frequencies(rope_settings(config, "llama"), 128)
    torch.testing.assert_close(inv, want, rtol=0, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)


def _meta_model(config: dict) -> DenseForCausalLM:
    with torch.device("meta"):
        return DenseForCausalLM(config)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)
def test_unsupported_rope_is_refused(change, message):
    config = {**REFERENCE_CONFIGS["meta-llama/Llama-3.1-8B-Instruct"], **change}
    with pytest.raises(NotImplementedError, match=message):
        _meta_model(config)


@pytest.mark.parametrize(
    "name",
    [
        "meta-llama/Llama-3.1-8B-Instruct",
        "mistralai/Mistral-7B-v0.1",
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen3-8B",
    ],
)
def test_published_configs_resolve_as_transformers(name):
    """Real config.json layouts (legacy rope_theta / rope_scaling): heads, head dim,
    windows and RoPE frequencies as transformers reads them."""
    config = REFERENCE_CONFIGS[name]
    assert model_class(config) is DenseForCausalLM
    fields = copy.deepcopy(config)
    ref_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = _meta_model(config)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (
        ref_cfg.num_attention_heads,
        ref_cfg.num_key_value_heads,
        getattr(ref_cfg, "head_dim", None) or ref_cfg.hidden_size // ref_cfg.num_attention_heads,
    )
    window = getattr(ref_cfg, "sliding_window", None)
    kinds = getattr(ref_cfg, "layer_types", None) or [None] * ref_cfg.num_hidden_layers
    want = [None if kind == "full_attention" else window for kind in kinds]
    assert [layer.self_attn.window for layer in model.model.layers] == want
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(ref_cfg)
    inv, scale = inverse_frequencies(rope_settings(config, name), attn.head_dim)
    torch.testing.assert_close(inv, rope.inv_freq, rtol=0, atol=0)
    assert scale == rope.attention_scaling
