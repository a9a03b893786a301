"""The benchmark's real shapes: configs that transformers and our cache planner accept with
the published sizes, and the per-token costs the machine ratios divide by."""

from __future__ import annotations

import json

import pytest
import transformers

from hybrid_pd.bench import real_shapes
from hybrid_pd.bench.checkpoints import build
from hybrid_pd.bench.machine import add_machine_ratios, checkpoint_costs
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config

# published sizes: (vocabulary, hidden, layers, attention layers)
SIZES = {
    "granite-4.0-h-350m-like": (100352, 768, 32, 4),
    "gemma-3-270m-like": (262144, 640, 18, 18),
    "qwen3.5-0.8b-like": (248320, 1024, 24, 6),
}


@pytest.mark.parametrize("name", sorted(real_shapes.REAL_SHAPES))
def test_a_real_shape_has_its_published_sizes(name):
    config_cls, _, fields, _ = real_shapes.REAL_SHAPES[name]
    got = fields()
    vocab, hidden, layers, attention = SIZES[name]
    assert (got["vocab_size"], got["hidden_size"], got["num_hidden_layers"]) == (
        vocab, hidden, layers,
    )  # fmt: skip
    assert len(got["layer_types"]) == layers
    assert sum("attention" in t and t != "linear_attention" for t in got["layer_types"]) == (
        attention
    )
    if config_cls is not None:  # transformers takes the fields as they are
        config = getattr(transformers, config_cls)(**got)
        assert config.vocab_size == vocab
        model_cls = real_shapes.REAL_SHAPES[name][1]
        spec = cache_spec_from_config({**config.to_dict(), "architectures": [model_cls]})
        assert spec is not None


def test_costs_count_the_layers_matrices_and_the_head(tmp_path):
    path = build("granite", tmp_path, 64)
    costs = checkpoint_costs(path, "float32")
    config = json.loads((path / "config.json").read_text())
    head = config["vocab_size"] * config["hidden_size"]
    assert costs["head_flops"] == 2 * head
    # every layer has weight matrices; the per-token count excludes the embedding and head
    assert 0 < costs["flops_per_token"] < 2 * 64 * 64 * 64 * config["num_hidden_layers"]
    assert costs["decode_weight_bytes"] > 4 * (head + costs["flops_per_token"] / 2)
    row = {"batch_size": 2, "prompt_len": 10}
    for side in ("ours", "vllm"):
        row |= {f"{side}_prefill_tokens_per_s": 100.0, f"{side}_decode_tokens_per_s": 20.0}
    add_machine_ratios(row, costs, {"gemm_peak_gflops": 50.0, "memcpy_gb_per_s": 10.0})
    want = 100 * (costs["flops_per_token"] + costs["head_flops"] / 10) / 1e9
    assert row["ours_prefill_gflops"] == round(want, 1)
    assert row["vllm_decode_weight_gb_per_s"] == round(10 * costs["decode_weight_bytes"] / 1e9, 2)


def test_gemma_like_greedy_tokens_vary():
    """The recipe's weights make a model whose greedy tokens vary (at a third of the depth
    and a small vocabulary, to stay quick): with its norms left at zero the scaled embedding
    outweighed every layer and one token repeated."""
    import torch

    config_cls, model_cls, fields, spread = real_shapes.REAL_SHAPES["gemma-3-270m-like"]
    got = fields() | {"vocab_size": 4096, "num_hidden_layers": 6}
    got["layer_types"] = got["layer_types"][:6]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**got)).eval()
    spread(model)
    prompts = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=8, do_sample=False)
    new = out[:, 32:].flatten().tolist()
    assert len(set(new)) >= 8, new
