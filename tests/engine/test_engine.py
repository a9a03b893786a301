"""The engine (scheduler + model + pool) on the built-in tiny model, against transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.engine.tiny import ensure_tiny

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return ensure_tiny(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def loaded(tiny_path):
    return load_model(tiny_path)


def make_engine(loaded, **kw) -> Engine:
    model, config, tok = loaded
    return Engine(model, config, EngineConfig(**kw), tok)


@pytest.fixture(scope="module")
def reference(tiny_path):
    """Greedy continuations from transformers on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # never stop early, like ignore_eos

    def run(prompt: list[int], n: int = 32) -> list[int]:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=258
            )
        return out[0, len(prompt) :].tolist()

    return run


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def assert_clean(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_requests == 0
    # Everything is free; cached-free blocks are allowed (prefix cache).
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 1


def test_tiny_matches_transformers_batched(loaded, reference):
    engine = make_engine(loaded)
    ps = [[5], *prompts(3, 40), prompts(1, 300, seed=1)[0]]
    outs = engine.generate(ps, GREEDY)
    for p, out in zip(ps, outs, strict=True):
        ref = reference(p)
        assert len(set(ref)) >= 4, "reference output does not vary; the test would prove little"
        assert out.token_ids == ref
    assert_clean(engine)


def test_chunked_prefill_and_small_budget(loaded, reference):
    engine = make_engine(loaded, max_num_batched_tokens=23)
    ps = prompts(2, 90, seed=2)
    outs = engine.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [reference(p) for p in ps]
    assert_clean(engine)


def test_prefix_cache_hits_state_snapshot(loaded, reference):
    engine = make_engine(loaded)
    shared = prompts(1, 120, seed=3)[0]
    first = engine.generate([[*shared, 1, 2, 3]], GREEDY)[0]
    second = engine.generate([[*shared, 1, 2, 3]], GREEDY)[0]
    assert second.num_cached_tokens > 0, "expected a prefix hit through the state snapshot"
    assert first.token_ids == second.token_ids == reference([*shared, 1, 2, 3])
    assert_clean(engine)


def test_a_chunk_keeps_the_snapshot_at_a_boundary_inside_it(loaded, reference):
    """A prompt chunk that passes the prompt's last block boundary runs whole and writes
    the states there to pages of their own on its way: the first token takes one step,
    and a prompt sharing those blocks starts from that snapshot, exactly. With no room
    for those pages the chunk ends at the boundary instead (two steps), as exact."""
    bs = make_engine(loaded).kv.block_size
    shared = prompts(1, 3 * bs, seed=12)[0]
    first, follow = [*shared, 7, 8, 9], [*shared, 10, 11]
    for room in (True, False):
        engine = make_engine(loaded)
        if not room:
            engine.kv.reserve_snapshots = lambda rid, n: None
        rid = engine.add_request(first, GREEDY)
        steps = 1
        while not engine.step():
            steps += 1
        assert steps == (1 if room else 2)
        assert engine.requests[rid].num_computed == len(first)
        outs = {o.request_id: o for o in engine.generate([first, follow], GREEDY)}
        again, other = outs.values()
        assert again.num_cached_tokens == other.num_cached_tokens == 3 * bs
        assert again.token_ids == reference(first) and other.token_ids == reference(follow)
        # the snapshot is cached now; a prompt that computes past it again (scoring its
        # prompt takes no prefix hit) runs its chunk whole, keeping nothing new
        if room:
            cached = engine.kv.pool.num_cached_blocks
            scored = dataclasses.replace(GREEDY, prompt_logprobs=1)
            rid = engine.add_request(first, scored)
            assert engine.step() and engine.requests[rid].num_computed == len(first)
            assert engine.kv.pool.num_cached_blocks >= cached
        while engine.has_unfinished():
            engine.step()
        assert_clean(engine)


def test_a_failed_step_frees_the_snapshot_pages_it_reserved(loaded):
    engine = make_engine(loaded)
    prompt = prompts(1, 3 * engine.kv.block_size + 2, seed=13)[0]
    engine.add_request(prompt, GREEDY)
    forward = engine.model.forward

    def broken(batch):
        assert any(s.snapshot for s in batch.seqs)  # the step holds reserved pages
        raise RuntimeError("injected")

    engine.model.forward = broken
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.model.forward = forward
    assert engine.fail_all()
    assert_clean(engine)
    assert engine.kv.pool.num_cached_blocks == 0  # nothing half-written was cached


def test_preemption_recomputes_exactly(loaded, reference):
    # A pool that cannot hold all requests at once forces preemption.
    engine = make_engine(loaded, kv_memory_bytes=2**20, enable_prefix_caching=False)
    ps = prompts(6, 60, seed=4)
    rids = [engine.add_request(p, GREEDY) for p in ps]
    reqs = [engine.requests[r] for r in rids]
    got = {}
    while engine.has_unfinished():
        got.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert sum(r.num_preemptions for r in reqs) > 0, "nothing was preempted"
    assert [got[r] for r in rids] == [reference(p) for p in ps]
    assert_clean(engine)


def test_rejects_requests_that_never_fit(loaded):
    engine = make_engine(loaded, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds the model's maximum length"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([10**6], SamplingParams())
    assert not engine.has_unfinished()


def test_abort_frees_blocks(loaded):
    engine = make_engine(loaded)
    rid = engine.add_request(prompts(1, 50)[0], SamplingParams(max_tokens=100))
    engine.step()
    assert engine.kv.has_request(rid)
    assert engine.abort(rid)
    assert_clean(engine)


def test_sampling_seeded_and_stops(loaded):
    engine = make_engine(loaded)
    p = prompts(1, 20, seed=5)[0]
    hot = SamplingParams(
        max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True
    )
    a, b = engine.generate([p, p], hot)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    greedy = engine.generate([p], GREEDY)[0].token_ids
    stop_at = greedy[5]
    out = engine.generate([p], SamplingParams(max_tokens=32, stop_token_ids=(stop_at,)))[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_logprobs_match_transformers(loaded, tiny_path):
    """Output and prompt log-probabilities equal log_softmax of transformers' logits over
    the whole sequence; chunked prefill and a prefix-cached twin change nothing."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    engine = make_engine(loaded, max_num_batched_tokens=16, block_size=8)
    prompt = prompts(1, 40, seed=3)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    engine.generate([prompt], SamplingParams(max_tokens=1))  # fills the prefix cache
    out = engine.generate([prompt], params)[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        lp = out.prompt_logprobs[p]
        assert lp.logprob == pytest.approx(float(lsm[p - 1, prompt[p]]), abs=1e-4)
        want = torch.topk(lsm[p - 1], 2)
        assert [t for t, _ in lp.top] == want.indices.tolist()
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = lsm[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert lp.top[0][0] == token  # greedy: the chosen token is the best one
        assert [v for _, v in lp.top] == pytest.approx(torch.topk(row, 3).values.tolist(), abs=1e-4)
    plain = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert plain.token_ids == out.token_ids and plain.logprobs is None
    assert_clean(engine)


def _state_blocks(engine: Engine, rid: str) -> list[int]:
    from hybrid_pd.kvcache.ids import RequestId

    ids = engine.kv.block_ids(RequestId(rid))
    groups = [g.group_id for g in engine.kv_config.groups if g.is_state]
    return [b for g in groups for b in ids[g]]


def test_state_rows_in_place_held_or_gathered_stay_exact(loaded, reference):
    """Decode steps update state rows in their pages (the CPU kernels, by block id); without
    that, rows are held between steps (KVPool) unless the budget is 0. Requests finishing at
    different steps, preemption in a small pool and prefix snapshots give the reference's
    tokens in all three ways, and each way was the one taken."""
    ps = prompts(6, 60, seed=8)
    lengths = [5, 32, 12, 32, 20, 9]
    runs = {}
    for mode, held in (("in_place", None), ("held", None), ("gathered", 0)):
        engine = make_engine(loaded, kv_memory_bytes=3 * 2**18, held_state_rows_bytes=held)
        engine.pool.rows_in_place = mode == "in_place"
        rids = [
            engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(ps, lengths, strict=True)
        ]
        reqs = [engine.requests[r] for r in rids]
        got = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    got[o.request_id] = o.token_ids
        preempted = sum(r.num_preemptions for r in reqs)
        pool = engine.pool
        runs[mode] = ([got[r] for r in rids], pool.held_hits, pool.in_place_updates, preempted)
        assert_clean(engine)
    want = [reference(p, n) for p, n in zip(ps, lengths, strict=True)]
    assert [run[0] for run in runs.values()] == [want] * 3
    assert runs["in_place"][1] == 0 and runs["in_place"][2] > 50
    assert runs["held"][1] > 50 and runs["held"][2] == 0
    assert runs["gathered"][1] == runs["gathered"][2] == 0
    assert all(run[3] for run in runs.values()), "the pool was meant to be too small"


def test_freed_state_blocks_reach_their_new_owner_fresh(loaded, reference):
    """A request that takes over the state blocks of one that just finished decodes from its
    own state, not the rows the pool held for the blocks' previous owner."""
    engine = make_engine(loaded, enable_prefix_caching=False)
    engine.pool.rows_in_place = False  # held rows are what this test is about
    first, second = prompts(2, 30, seed=9)
    a = engine.add_request(first, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    blocks_a = _state_blocks(engine, a)
    while engine.has_unfinished():
        engine.step()
    hits = engine.pool.held_hits
    assert hits > 0
    b = engine.add_request(second, SamplingParams(max_tokens=6, ignore_eos=True))
    out = []
    engine.step()
    assert _state_blocks(engine, b) == blocks_a, "the test needs the same blocks reused"
    while engine.has_unfinished():
        out = [o.token_ids for o in engine.step() if o.finished] or out
    assert out == [reference(second, 6)]
    assert engine.pool.held_hits > hits


def test_aborts_and_failures_outside_a_step_write_held_rows_and_free_every_block(loaded, reference):
    """A worker aborts requests and fails steps outside the engine's step (outside torch's
    inference mode, where the held rows were made): the rows still reach their pages, every
    block is freed, and the requests left keep the reference's tokens."""
    kept, aborted, failed = prompts(3, 30, seed=10)
    engine = make_engine(loaded)
    engine.pool.rows_in_place = False  # held rows are what this test is about
    keep = engine.add_request(kept, SamplingParams(max_tokens=8, ignore_eos=True))
    drop = engine.add_request(aborted, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.held_rows_total > 0, "nothing was held: the abort tests nothing"
    assert not torch.is_inference_mode_enabled()
    assert engine.abort(drop) is not None
    out = {}
    while engine.has_unfinished():
        out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert out == {keep: reference(kept, 8)}
    assert_clean(engine)

    engine.add_request(failed, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.held_rows_total > 0
    assert len(engine.fail_all()) == 1
    assert engine.pool.held_rows_total == 0
    assert_clean(engine)
