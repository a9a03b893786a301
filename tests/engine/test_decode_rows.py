"""Batched decode attention (`paged_attention.DecodeRows`) in mixed batches: the one-token
sequences of a step are attended by one SDPA call over a padded gather of their blocks, the
prefill chunks per sequence. Every step's logits must equal a run that loops over all
sequences, and the greedy tokens must equal transformers', with sliding windows that cross
block boundaries at every step and stale NaN bytes in every page a row gathers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pd.engine import paged_attention
from hybrid_pd.engine.loader import load_model
from tests import checkpoints
from tests.engine.harness import PagedRunner, mixed_step, staggered
from tests.engine.mamba2_parity import NEW, Reference, prompt

TOL = 2e-5  # of the largest logit: float32, SDPA vs einsum order over 24 steps
LENGTHS = (1, 9, 30, 5, 17)  # windows of 16 (SW_WINDOW) slide across blocks of 4


pytestmark = pytest.mark.usefixtures("one_thread")


# Gemma 3 (sliding + full groups), Mistral (sliding everywhere), Granite (attention + Mamba2).
@pytest.fixture(scope="module", params=["gemma3", "mistral", "granite_hybrid"])
def arch(request, tmp_path_factory):
    path = getattr(checkpoints, request.param)(tmp_path_factory.mktemp(request.param))
    model, config, _ = load_model(path)
    return request.param, model, config, Reference(path)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batches_match_the_loop_and_transformers(arch, block_size, monkeypatch):
    name, model, config, ref = arch
    prompts = [prompt(n, 70 + i) for i, n in enumerate(LENGTHS)]
    runner = PagedRunner(model, config, block_size=block_size)
    # stale bytes: 0xFF is NaN as any float; rows gather them past their last token, in
    # padding and before their window, and must mask and zero them (null block included)
    runner.pool.buffer.fill_(0xFF)
    tokens, logits, mixed = staggered(runner, prompts, NEW)
    assert mixed >= 5, "too few steps mix decodes and prefill chunks to prove anything"
    assert torch.isfinite(logits).all()

    monkeypatch.setattr(paged_attention, "MIN_DECODE_ROWS", 10**9)
    loop_runner = PagedRunner(model, config, block_size=block_size)
    loop_tokens, loop_logits, _ = staggered(loop_runner, prompts, NEW)

    diff = (logits - loop_logits).abs().max().item()
    scale = logits.abs().max().item()
    assert diff < TOL * scale, f"{name}: batched and looped logits differ by {diff} of {scale}"
    assert tokens == loop_tokens
    want = [ref(p)[1] for p in prompts]
    assert tokens == want, name
    assert len({tuple(w) for w in want}) == len(prompts), "weights too flat: same continuations"


def test_plan_is_built_once_per_step_and_group(arch):
    """Every attention layer of a group shares one plan: decode rows plus looped chunks."""
    _, model, config, _ = arch
    batch, runner = mixed_step(model, config)
    plans = {k: v for k, v in batch.memo.items() if k[0] == "attention"}
    groups = {g.group_id for g in runner.config.groups if not g.is_state}
    assert {k[1] for k in plans} == groups
    for plan in plans.values():
        assert plan.rows.tokens.tolist() == [0, 5]
        assert plan.rows.slots.tolist() == [3, 1]  # positions 3 and 5, blocks of 4
        assert [p.seq.request_id for p in plan.loop] == ["c"]
