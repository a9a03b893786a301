"""Batched state updates (`paged.split_state_seqs`) in mixed batches, for the Mamba2 hybrids,
Jamba (Mamba1) and Gated DeltaNet: the one-token sequences of a step go through one stacked
update, the others through the per-sequence loop. Every step's logits must equal a run that
loops over all sequences, and the greedy tokens must equal transformers'."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hybrid_pd.engine import paged
from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from tests import checkpoints
from tests.engine.harness import PagedRunner, mixed_step, staggered
from tests.engine.mamba2_parity import GREEDY, NEW, Reference, prompt

TOL = 2e-5  # of the largest logit: float32 rounding over 24 steps, batched vs looped order
LENGTHS = (1, 9, 30, 5, 17)  # the 1-token prompt starts from a zero state in a batched row


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(
    scope="module",
    params=["granite_hybrid", "bamba", "nemotron_h", "jamba", "qwen3_5", "qwen3_next"],
)
def arch(request, tmp_path_factory):
    path = getattr(checkpoints, request.param)(tmp_path_factory.mktemp(request.param))
    model, config, tok = load_model(path)
    return request.param, model, config, tok, Reference(path)


def _loop_everything(monkeypatch) -> None:
    monkeypatch.setattr(paged, "MIN_STATE_ROWS", 10**9)


@pytest.mark.parametrize("block_size", [4, 128])  # state spread over blocks / in one block
def test_mixed_batches_match_the_loop_and_transformers(arch, block_size, monkeypatch):
    name, model, config, _, ref = arch
    prompts = [prompt(n, 40 + i) for i, n in enumerate(LENGTHS)]
    runner = PagedRunner(model, config, block_size=block_size)
    spans = {g.blocks_per_state for g in runner.config.groups if g.is_state}
    assert spans == ({1} if block_size == 128 else spans - {1}), spans

    tokens, logits, mixed = staggered(runner, prompts, NEW)
    assert mixed >= 5, "too few steps mix decodes and prefill chunks to prove anything"
    _loop_everything(monkeypatch)
    loop_runner = PagedRunner(model, config, block_size=block_size)
    loop_tokens, loop_logits, _ = staggered(loop_runner, prompts, NEW)

    diff = (logits - loop_logits).abs().max().item()
    scale = logits.abs().max().item()
    assert diff < TOL * scale, f"{name}: batched and looped logits differ by {diff} of {scale}"
    assert tokens == loop_tokens
    want = [ref(p)[1] for p in prompts]
    assert tokens == want, name
    assert len({tuple(w) for w in want}) == len(prompts), "weights too flat: same continuations"
    assert all(len(set(w)) >= 4 for w in want), "reference output too repetitive"


def test_split_is_built_once_per_step_and_group(arch):
    """The rows are shared by every state layer of a group: one split per group and step."""
    _, model, config, _, _ = arch
    batch, runner = mixed_step(model, config)
    state_groups = {g.group_id for g in runner.config.groups if g.is_state}
    splits = {k: v for k, v in batch.memo.items() if k[0] == "state_rows"}
    assert {key[1] for key in splits} == state_groups
    rows, rest = next(iter(splits.values()))
    assert rows.tokens.tolist() == [0, 5] and [s.request_id for s in rest] == ["c"]
    assert rows.fresh.tolist() == [False, False] and not rows.any_fresh
    span = next(g.blocks_per_state for g in runner.config.groups if g.is_state)
    assert rows.blocks.shape == (2, span)


def test_engine_with_requests_joining_mid_run(arch, monkeypatch):
    """The real engine: requests added every third step join running decodes with chunked
    prefill (9 tokens a step); batched and looped give the reference's tokens."""
    _, model, config, tok, ref = arch
    prompts = [prompt(n, 60 + n) for n in (12, 1, 26, 4)]

    def run() -> list[list[int]]:
        engine = Engine(
            model,
            config,
            EngineConfig(kv_memory_bytes=8 * 2**20, max_num_batched_tokens=9),
            tok,
        )
        rids, got, step = [], {}, 0
        while len(rids) < len(prompts) or engine.has_unfinished():
            if step % 3 == 0 and len(rids) < len(prompts):
                rids.append(engine.add_request(prompts[len(rids)], GREEDY))
            for o in engine.step():
                if o.finished:
                    got[o.request_id] = o.token_ids
            step += 1
        assert engine.kv.num_requests == 0
        return [got[r] for r in rids]

    batched = run()
    _loop_everything(monkeypatch)
    assert run() == batched == [ref(p)[1] for p in prompts]
