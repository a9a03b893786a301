"""Tensor parallelism in the engine.

- Shards: every split parameter's rank shards, put back together, are the whole tensor;
  replicated units (KV heads, Mamba2 groups) go whole to the ranks that read them.
- Greedy tokens: an engine of N real rank processes (gloo on loopback) equals the engine
  at TP 1 on the same checkpoint (float32), over rounds of prompts prefilled in chunks
  side by side, with prefix-cache hits in later rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_pd.engine.engine import Engine
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.registry import model_class
from hybrid_pd.engine.tp.build import shard_model
from hybrid_pd.engine.tp.group import TPGroup
from hybrid_pd.engine.tp.head import install_vocab_shard
from hybrid_pd.engine.tp.plans import TPConfigError, plan_for
from hybrid_pd.engine.tp.shard import LEADER_ONLY, Seg, Split, owned_units, shard_tensor
from hybrid_pd.kvcache.hf_configs import load_config
from tests import checkpoints
from tests.engine.tp_scenario import engine_config, run_rounds, scored_rounds

REPO = Path(__file__).resolve().parents[2]

# checkpoint builder name, overrides, TP sizes
CASES = {
    "llama": ("llama", {}, (2, 4)),
    "gemma3": ("gemma3", {}, (2,)),
    "qwen3_5": ("qwen3_5", {}, (2,)),
    "granite_groups2": ("granite_hybrid", {}, (2,)),
    "granite_groups1": ("granite_hybrid", {"name": "granite_g1", "mamba_n_groups": 1}, (2,)),
    "jamba": ("jamba", {}, (2,)),
    # mamba_expand 4: a rank's Mamba inner size stays a multiple of hidden_size at 4 ranks
    "jamba_expand4": ("jamba", {"name": "jamba_e4", "mamba_expand": 4}, (4,)),
    "gpt_oss": ("gpt_oss", {}, (2, 4)),
    "llama4": ("llama4", {}, (2, 4)),
    # 2 Mamba2 groups, 2 KV heads: split at 2 ranks; replicated (norm groups spanning ranks)
    # at 4
    "bamba": ("bamba", {}, (2, 4)),
    "falcon_h1": ("falcon_h1", {}, (2, 4)),
    # one group spanning both ranks, normalised before the gate
    "falcon_h1_norm_first": (
        "falcon_h1",
        {"name": "falcon_h1_nf", "mamba_n_groups": 1, "mamba_norm_before_gate": True},
        (2,),
    ),
    "nemotron_h": ("nemotron_h", {}, (2, 4)),
    # MoE blocks (routed experts through a latent projection, biased, and a shared expert)
    "nemotron_h_moe": (
        "nemotron_h",
        {
            "name": "nemotron_h_moe",
            "hybrid_override_pattern": "ME*M-E",
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 48,
            "moe_latent_size": 40,
            "n_group": 2,
            "topk_group": 1,
        },
        (2,),
    ),
}
# a prompt long enough for several chunks; the second round repeats its first 32 tokens
# (prefix-cache hits, state snapshots included)
_LONG = [5, 17, 99, 23, 41, 8, 77, 120, 3, 9, 44, 61, 200, 13, 2, 90, 31, 7, 15, 16, 250, 33]
_LONG += [4, 1, 6, 70, 71, 72, 9, 10, 11, 190]
PROMPTS = [
    [[*_LONG, 191, 12], [40, 41, 42, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]],
    [[*_LONG, 100, 101], [8, 8, 8]],
]
NEW = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for case, (builder, overrides, _) in CASES.items():
        out[case] = checkpoints.BUILDERS[builder](root, **overrides)
    return out


# ---------------------------------------------------------------------------- shards


def test_owned_units_split_and_replicate():
    assert [owned_units(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    # fewer units than ranks: consecutive ranks share the unit their heads read
    assert [owned_units(2, 4, r, replicate=True) for r in range(4)] == [
        range(0, 1),
        range(0, 1),
        range(1, 2),
        range(1, 2),
    ]
    with pytest.raises(ValueError):
        owned_units(2, 4, 0)  # query heads never replicate
    with pytest.raises(ValueError):
        owned_units(3, 2, 0, replicate=True)


def test_shard_tensor_takes_each_segment_share():
    t = torch.arange(2 * 3 + 2 * 2 + 1 * 4, dtype=torch.float32)[:, None].repeat(1, 2)
    split = Split(0, (Seg(2, 3), Seg(2, 2), Seg(1, 4, replicate=True)))
    r0, r1 = (shard_tensor(t, split, 2, r) for r in range(2))
    assert r0[:, 0].tolist() == [0, 1, 2, 6, 7, 10, 11, 12, 13]
    assert r1[:, 0].tolist() == [3, 4, 5, 8, 9, 10, 11, 12, 13]
    bias = torch.ones(3)
    assert shard_tensor(bias, LEADER_ONLY, 2, 0).tolist() == [1, 1, 1]
    assert shard_tensor(bias, LEADER_ONLY, 2, 1).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="expects"):
        shard_tensor(torch.zeros(5), split, 2, 0)


def test_unsplittable_sizes_are_refused_by_name(folders):
    config = load_config(folders["llama"])  # 4 heads, 2 KV heads
    with pytest.raises(TPConfigError, match="num_attention_heads"):
        plan_for(config, 3)
    with pytest.raises(TPConfigError, match="not available for"):
        plan_for({"architectures": ["SomethingElse"]}, 2)


def test_jamba_inner_size_must_stay_a_multiple_of_hidden(folders):
    """Jamba's model and cache planner read the Mamba inner size as an integer
    mamba_expand times hidden_size: more ranks than mamba_expand divides are refused."""
    config = load_config(folders["jamba"])  # mamba_expand 2
    assert plan_for(config, 2).rank_config["mamba_expand"] == 1
    with pytest.raises(TPConfigError, match="mamba_expand"):
        plan_for(config, 4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_shards_put_together_are_the_whole(case, folders):
    """Each split parameter: the ranks' shards, segment by segment, concatenated in rank
    order (a replicated unit counted once) equal the TP-1 tensor; unsplit ones are equal
    on every rank, and so are the checkpoint's buffers; row-parallel biases live on rank 0
    only."""
    for size in CASES[case][2]:
        full, config, _ = load_model(folders[case])
        plan = plan_for(config, size)
        cls = model_class(config)
        ranks = []
        for rank in range(size):
            m = cls(plan.rank_config)
            shard_model(full, m, plan, TPGroup(rank, size))
            ranks.append(dict(m.named_parameters(remove_duplicate=False)))
            # checkpoint buffers (Nemotron-H's router correction bias) come along whole
            buffers = dict(m.named_buffers())
            for name, whole in full.state_dict().items():
                if name in buffers:
                    assert torch.equal(buffers[name], whole), name
        for name, whole in full.named_parameters(remove_duplicate=False):
            rule = plan.params.rule_for(name)
            parts = [r[name].detach() for r in ranks]
            if rule is None:
                assert all(torch.equal(p, whole) for p in parts), name
            elif rule == LEADER_ONLY:
                assert torch.equal(parts[0], whole) and not any(p.any() for p in parts[1:])
            else:
                assert torch.equal(_reassemble(parts, rule, size), whole), name


def _reassemble(parts, rule: Split, size: int) -> torch.Tensor:
    pieces, offsets = [], [0] * size
    for seg in rule.segs:
        seen = set()
        for rank, part in enumerate(parts):
            mine = owned_units(seg.units, size, rank, seg.replicate)
            width = len(mine) * seg.width
            if mine.start not in seen:
                seen.add(mine.start)
                pieces.append(part.narrow(rule.dim, offsets[rank], width))
            offsets[rank] += width
    return torch.cat(pieces, dim=rule.dim)


# ---------------------------------------------------------------------------- tokens


def tp_tokens(
    folder: Path, size: int, rounds, new: int, max_batched_tokens: int = 24, logprobs: int = 0
) -> dict:
    """Greedy tokens of an engine of `size` real rank processes (tests/engine/tp_scenario.py)
    over `rounds` of prompts (with `logprobs`: `scored_rounds`' outputs)."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HYBRID_PD_TP_HEAD_SPLIT_MIN": "0",  # these checkpoints' heads are tiny: split anyway
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.tp_scenario", "--model", str(folder),
         "--size", str(size), "--rounds", json.dumps(rounds), "--new", str(new),
         "--max-batched-tokens", str(max_batched_tokens), "--logprobs", str(logprobs)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    ("case", "size"), [(c, s) for c, (_, _, sizes) in sorted(CASES.items()) for s in sizes]
)
def test_tp_engine_equals_tp1(case, size, folders):
    model, config, tok = load_model(folders[case])
    reference = run_rounds(Engine(model, config, engine_config(), tok), PROMPTS, NEW)
    flat = [t for rnd in reference for out in rnd for t in out]
    assert len(set(flat)) > NEW, "the checkpoint's greedy outputs hardly vary: a weak test"
    got = tp_tokens(folders[case], size, PROMPTS, NEW)
    assert got["tokens"] == reference
    assert got["follower_exit_codes"] == [0] * (size - 1)
    assert got["steps"] > len(PROMPTS)  # chunked: several steps per round


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", ["granite_groups1", "gemma3"])  # an untied, a tied head
def test_tp_logprobs_come_from_every_ranks_rows_of_the_head(case, folders):
    """Each rank computes its run of the head's vocabulary rows; rank 0 names the rows
    (sampled, and prompt slices for prompt logprobs) and the followers join in. Tokens,
    top ids and log-probabilities equal TP 1's (values up to the partial sums' order)."""
    model, config, tok = load_model(folders[case])
    reference = scored_rounds(Engine(model, config, engine_config(), tok), PROMPTS, NEW, 3)
    got = tp_tokens(folders[case], 2, PROMPTS, NEW, logprobs=3)
    assert got["follower_exit_codes"] == [0]
    assert got["head_rows"] == [0, config["vocab_size"] // 2]  # rank 0's half
    for rnd_ref, rnd_got in zip(reference, got["tokens"], strict=True):
        for ref, out in zip(rnd_ref, rnd_got, strict=True):
            assert out[0] == ref[0]
            for scores_ref, scores in ((ref[1], out[1]), (ref[2], out[2])):
                assert len(scores) == len(scores_ref) and scores_ref[-1] is not None
                for a, b in zip(scores_ref, scores, strict=True):
                    if a is None:
                        assert b is None
                        continue
                    assert [i for i, _ in b[1]] == [i for i, _ in a[1]]
                    assert b[0] == pytest.approx(a[0], abs=1e-4)
                    assert [v for _, v in b[1]] == pytest.approx([v for _, v in a[1]], abs=1e-4)


def test_only_a_head_worth_splitting_is_split(monkeypatch):
    monkeypatch.delenv("HYBRID_PD_TP_HEAD_SPLIT_MIN", raising=False)
    group = TPGroup(rank=1, size=2)
    tiny, real = torch.nn.Module(), torch.nn.Module()
    install_vocab_shard(tiny, group, {"vocab_size": 300, "hidden_size": 64})
    install_vocab_shard(real, group, {"text_config": {"vocab_size": 262_144, "hidden_size": 640}})
    assert not hasattr(tiny, "vocab_shard")  # rank 0 computes it whole, as at TP 1
    assert real.vocab_shard.rows(262_144) == (131_072, 262_144)
    alone = torch.nn.Module()
    install_vocab_shard(alone, TPGroup(), {"vocab_size": 10**6, "hidden_size": 64})  # TP 1
    assert not hasattr(alone, "vocab_shard")
