"""Remote KV inside the scheduler: a decode engine's requests wait for blocks in the queue,
their loads run through the connector's worker side, and the outcome is applied between
steps: run from prompt + first token, recompute, or fail.

The connector here is an in-process stand-in (the subject is the engine): loads copy the
blocks from a prefill engine's pool, or write garbage and fail, when the test says so. The
real connector over UCX and gRPC is exercised in tests/connector/.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from hybrid_pd.connector.base import KVConnector, LoadResult
from hybrid_pd.connector.segments import plan_segments
from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.loop import EngineLoop
from hybrid_pd.engine.request import Status
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.kvcache.ids import NULL_BLOCK_ID
from tests.checkpoints import BUILDERS

N_NEW = 12
PARAMS = SamplingParams(max_tokens=N_NEW, ignore_eos=True)


class KeepAll:
    """Prefill side: keep every finished prefill's blocks; params name them."""

    def request_finished_all_groups(self, request, block_ids):
        kept = tuple(tuple(b for b in g if b != NULL_BLOCK_ID) for g in block_ids)
        return True, {"blocks": kept, "first": request.output_ids[0]}


class ScriptedLoads:
    """Decode side: loads start when the scheduler says, end when the test says."""

    def __init__(self, src_pool) -> None:
        self.src_pool = src_pool
        self.dst_pool = None
        self.started: dict[str, tuple[list, list]] = {}
        self.held: dict[str, tuple[int, ...]] = {}
        self.order: list[str] = []
        self._done: list[LoadResult] = []

    def start_load_kv(self, request_id, params, block_ids, held=()) -> None:
        # As the real connector does: the first held[g] real blocks are not loaded.
        held = held or (0,) * len(block_ids)
        real = [[b for b in g if b != NULL_BLOCK_ID] for g in block_ids]
        dst = [g[n:] for g, n in zip(real, held, strict=True)]
        src = [list(g[n:]) for g, n in zip(params["blocks"], held, strict=True)]
        self.started[request_id] = (src, dst)
        self.held[request_id] = tuple(held)
        self.order.append(request_id)

    def complete(self, request_id: str) -> None:
        src, dst = self.started.pop(request_id)
        for s in plan_segments(src, dst):
            self.dst_pool.region(s.dst, s.length).copy_(self.src_pool.region(s.src, s.length))
        self._done.append(LoadResult(request_id, None, 1, 1, 0.0))

    def break_halfway(self, request_id: str) -> int:
        """Write garbage into the second half of each group's loaded blocks, then fail."""
        _, dst = self.started.pop(request_id)
        written = 0
        for real in dst:
            for b in real[len(real) // 2 :]:
                region = self.dst_pool.region(b, 1)
                region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8))
                written += 1
        self._done.append(LoadResult(request_id, "peer died during the pull"))
        return written

    def get_finished(self):
        out, self._done = self._done, []
        return out

    def has_finished(self) -> bool:
        return bool(self._done)

    def keep_alive(self, params) -> None:
        pass


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def loaded(request, checkpoint):
    return load_model(checkpoint(request.param))


def make_engine(loaded, kv_memory: int = 4 * 2**20, connector=None, reuse=True) -> Engine:
    model, config, tok = loaded
    cfg = EngineConfig(kv_memory_bytes=kv_memory, reuse_prefix_on_load=reuse)
    return Engine(model, config, cfg, tok, connector)


def prompt_of(engine: Engine, blocks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    # A whole number of blocks (a state snapshot boundary), longer than any window.
    return torch.randint(3, 256, (blocks * engine.kv.block_size,), generator=g).tolist()


def prefill(engine: Engine, prompt: list[int]) -> dict:
    rid = engine.add_request(prompt, PARAMS, remote_decode=True)
    for _ in range(100):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                assert out.finish_reason == "remote_decode"
                return out.kv_transfer_params
    raise AssertionError("prefill did not finish")


def drive(engine: Engine, loads: ScriptedLoads, action, max_steps: int = 400) -> dict:
    """Step until every request finished; `action(loads)` runs before each step (end
    loads there). Returns the final outputs by request id."""
    final = {}
    for _ in range(max_steps):
        action(loads)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished():
            return final
    raise AssertionError("requests did not finish")


def pd_pair(loaded, decode_memory: int = 4 * 2**20, reuse: bool = True):
    source = make_engine(loaded, connector=KVConnector(scheduler=KeepAll()))
    loads = ScriptedLoads(source.pool)
    decode = make_engine(loaded, decode_memory, KVConnector(worker=loads), reuse)
    loads.dst_pool = decode.pool
    return source, decode, loads


def complete_all(loads: ScriptedLoads) -> None:
    for rid in list(loads.started):
        loads.complete(rid)


def assert_clean(engine: Engine) -> None:
    engine.kv.check_integrity()
    assert engine.kv.num_requests == 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 1


def test_remote_kv_runs_from_prompt_and_first_token(loaded):
    source, decode, loads = pd_pair(loaded)
    prompt = prompt_of(source, 5, seed=1)
    want = make_engine(loaded).generate([prompt], PARAMS)[0].token_ids
    assert len(set(want)) > 2, "random weights too flat: greedy output does not vary"
    kv = prefill(source, prompt)
    assert kv["first"] == want[0]
    rid = decode.add_request(prompt, PARAMS, "d", output_ids=[kv["first"]], remote_kv=kv)
    decode.step()  # its turn: blocks allocated, load started, nothing computed
    assert rid in loads.started
    assert decode.scheduler.receiving[rid].status is Status.WAITING_FOR_REMOTE_KV
    decode.step()  # the load has not ended: the request stays where it is
    assert rid in decode.scheduler.receiving
    out = drive(decode, loads, complete_all)[rid]
    assert out.token_ids == want and out.load_result.error is None and not out.recomputed
    assert_clean(decode)


def test_recompute_after_half_written_transfer(loaded):
    """The blocks of a broken pull hold garbage; none of it may enter the prefix cache (a
    state page freed on a block boundary used to become a snapshot that the recompute hit
    once the prompt's attention blocks were cached: wrong greedy tokens). Without
    decode-side reuse, so the cached blocks are loaded (and broken) again."""
    source, decode, loads = pd_pair(loaded, reuse=False)
    prompt = prompt_of(source, 6, seed=5)
    # The decode engine has run this prompt before: its attention blocks are cached.
    want = decode.generate([prompt], PARAMS)[0].token_ids
    kv = prefill(source, prompt)
    rid = decode.add_request(prompt, PARAMS, "r", output_ids=[kv["first"]], remote_kv=kv)
    decode.step()
    assert loads.break_halfway(rid) > 0
    out = drive(decode, loads, complete_all)[rid]
    assert out.recomputed and out.token_ids == want
    assert_clean(decode)
    # And again, now that a recompute has run: still exact.
    kv = prefill(source, prompt)
    rid = decode.add_request(prompt, PARAMS, "r2", output_ids=[kv["first"]], remote_kv=kv)
    decode.step()
    loads.break_halfway(rid)
    assert drive(decode, loads, complete_all)[rid].token_ids == want


def test_follow_up_turn_loads_only_what_decode_lacks(loaded):
    """Decode-side prefix reuse: a second turn (the first turn's prompt and answer, then
    more) loads only the blocks past what decode's prefix cache holds, never a state page
    from the cache, and gives the single engine's tokens; a broken load of the rest is
    recomputed exactly and leaves the held blocks intact."""
    source, decode, loads = pd_pair(loaded)
    bs = decode.kv.block_size
    single = make_engine(loaded)
    turn1 = prompt_of(source, 3, seed=21)
    kv = prefill(source, turn1)
    rid = decode.add_request(turn1, PARAMS, "t1", output_ids=[kv["first"]], remote_kv=kv)
    decode.step()
    assert loads.held["t1"] == (0,) * len(decode.kv.managers)  # a cold cache holds nothing
    out1 = drive(decode, loads, complete_all)[rid]
    assert out1.token_ids == single.generate([turn1], PARAMS)[0].token_ids
    turn2 = turn1 + out1.token_ids + prompt_of(source, 2, seed=22)[: 2 * bs - 3]
    want = make_engine(loaded).generate([turn2], PARAMS)[0].token_ids
    kinds = [type(m).__name__ for m in decode.kv.managers]
    # t2: turn 1's prompt and all but its last answer token fill the blocks decode holds;
    # t3 (the same turn again, its load broken halfway): t2 left every whole block cached.
    expect = {"t2": (len(turn1) + N_NEW - 1) // bs, "t3": len(turn2) // bs}
    for attempt, end in (("t2", complete_all), ("t3", None)):
        kv = prefill(source, turn2)
        rid = decode.add_request(turn2, PARAMS, attempt, output_ids=[kv["first"]], remote_kv=kv)
        decode.step()
        held = loads.held[attempt]
        for kind, n, m in zip(kinds, held, decode.kv.managers, strict=True):
            if kind == "FullAttentionManager":
                assert n == expect[attempt]
            elif kind == "StateManager":
                assert n == 0
            else:  # a window: at most the whole blocks it keeps at turn 2's end
                first = m.first_needed_block(len(turn2))
                assert n <= max(0, expect[attempt] - first)
        if any(m.group.spec.kind == "full" for m in decode.kv.managers):
            assert decode.requests[attempt].num_cached_tokens > 0
        if end is None:
            assert loads.break_halfway(rid) > 0
            end = complete_all
        out = drive(decode, loads, end)[rid]
        assert out.token_ids == want, attempt
        assert out.recomputed == (attempt == "t3")
        assert_clean(decode)


def test_failure_policy_fail_reports_and_frees(loaded):
    source, decode, loads = pd_pair(loaded)
    prompt = prompt_of(source, 3, seed=2)
    kv = prefill(source, prompt)
    rid = decode.add_request(
        prompt, PARAMS, "f", output_ids=[kv["first"]], remote_kv=kv, on_load_failure="fail"
    )
    decode.step()
    loads.break_halfway(rid)
    out = drive(decode, loads, lambda _: None)[rid]
    assert out.finish_reason == "error" and "peer died" in out.error
    assert_clean(decode)


def test_abort_while_receiving_frees_after_the_load_ends(loaded):
    source, decode, loads = pd_pair(loaded)
    prompt = prompt_of(source, 4, seed=3)
    kv = prefill(source, prompt)
    rid = decode.add_request(prompt, PARAMS, "a", output_ids=[kv["first"]], remote_kv=kv)
    decode.step()
    held = decode.kv.pool.num_free_blocks
    assert decode.abort(rid) is not None
    decode.step()
    # The load may still be writing into the blocks: they stay allocated until it ends.
    assert decode.kv.pool.num_free_blocks == held and decode.kv.has_request(rid)
    loads.complete(rid)
    decode.step()
    assert_clean(decode)


def test_queue_longer_than_the_pool_all_finish_in_order(loaded):
    """More remote requests than the decode pool holds: they wait in the scheduler queue (no
    timeouts), get blocks in arrival order as others finish, and all give exact tokens."""
    probe = make_engine(loaded)
    prompts = [prompt_of(probe, 4, seed=10 + i) for i in range(8)]
    need = probe.kv.config.blocks_per_request(len(prompts[0]) + N_NEW)
    # Room for about two requests at a time.
    memory = (2 * need + 1) * probe.kv_config.page_size_bytes
    source, decode, loads = pd_pair(loaded, decode_memory=memory)
    assert decode.kv.pool.num_blocks - 1 < 3 * need
    want = [probe.generate([p], PARAMS)[0].token_ids for p in prompts]
    rids = []
    for i, p in enumerate(prompts):
        kv = prefill(source, p)
        rids.append(decode.add_request(p, PARAMS, f"q{i}", output_ids=[kv["first"]], remote_kv=kv))
    final = drive(decode, loads, complete_all)
    assert [final[r].token_ids for r in rids] == want
    assert loads.order == rids  # blocks granted first come, first served
    assert_clean(decode)


class ThreadedLoads(ScriptedLoads):
    """ScriptedLoads whose loads end on another thread after `delay_s` (as real pulls do)
    and wake the loop."""

    def __init__(self, src_pool, delay_s: float) -> None:
        super().__init__(src_pool)
        self.delay_s = delay_s
        self.notify = lambda: None
        self._lock = threading.Lock()

    def start_load_kv(self, request_id, params, block_ids, held=()) -> None:
        with self._lock:
            super().start_load_kv(request_id, params, block_ids)
        threading.Timer(self.delay_s, self._end, (request_id,)).start()

    def _end(self, request_id: str) -> None:
        with self._lock:
            self.complete(request_id)
        self.notify()

    def get_finished(self):
        with self._lock:
            return super().get_finished()


def test_engine_loop_wakes_on_load_end_not_on_its_tick(loaded):
    """Requests submitted from other threads, loads ending on yet other threads: everything
    finishes exactly, promptly (the loop is woken; its 5 s tick never comes), and the
    published snapshot shows a clean pool afterwards."""
    source = make_engine(loaded, connector=KVConnector(scheduler=KeepAll()))
    loads = ThreadedLoads(source.pool, delay_s=0.05)
    decode = make_engine(loaded, connector=KVConnector(worker=loads))
    loads.dst_pool = decode.pool
    prompts = [prompt_of(source, 2 + i % 3, seed=40 + i) for i in range(6)]
    want = [make_engine(loaded).generate([p], PARAMS)[0].token_ids for p in prompts]
    kvs = [prefill(source, p) for p in prompts]
    loop = EngineLoop(decode, tick_s=5.0)
    loads.notify = loop.wake
    outputs: dict[str, queue.Queue] = {}
    try:
        t0 = time.monotonic()
        for i, (p, kv) in enumerate(zip(prompts, kvs, strict=True)):
            q = outputs[f"w{i}"] = queue.Queue()
            loop.submit(
                p, PARAMS, f"w{i}", output_ids=[kv["first"]], remote_kv=kv, sink=q.put
            ).result(5)
        got = []
        for i in range(len(prompts)):
            while (out := outputs[f"w{i}"].get(timeout=10)) and not out.finished:
                pass
            got.append(out.token_ids)
        assert got == want
        assert time.monotonic() - t0 < 4.0
        loop.post(lambda: None).result(5)  # the loop publishes after ops when idle
        snap = loop.snapshot
        assert snap["integrity"] == "ok" and snap["kv_requests"] == 0
        assert snap["free_blocks"] == snap["num_blocks"] - 1
    finally:
        loop.stop()


@pytest.mark.parametrize("in_place", [False, True])
def test_state_held_by_the_prefill_pool_reaches_the_decode_worker(loaded, in_place):
    """A prompt whose last prefill chunk is one token runs that chunk as a batched state
    row, which the pool holds instead of writing; handing the request over writes it to
    the pages the decode worker loads, so decode still gives the single engine's tokens.
    With rows updated in their pages (`in_place`, where the kernels apply) nothing is held
    and the pages are current already."""
    model, config, tok = loaded
    cfg = EngineConfig(kv_memory_bytes=4 * 2**20, max_num_batched_tokens=9)
    source = Engine(model, config, cfg, tok, KVConnector(scheduler=KeepAll()))
    if not any(g.is_state for g in source.kv_config.groups):
        pytest.skip("no state layers")
    source.pool.rows_in_place = in_place
    loads = ScriptedLoads(source.pool)
    decode = make_engine(loaded, connector=KVConnector(worker=loads))
    loads.dst_pool = decode.pool
    held_at_flush = []
    flush = source.pool.flush_rows

    def recording_flush(block_ids=None):
        held_at_flush.append(source.pool.held_rows_total)
        flush(block_ids)

    source.pool.flush_rows = recording_flush
    g = torch.Generator().manual_seed(31)
    # chunks of 9, 9 and 1 (a state snapshot inside a chunk does not end it)
    prompt = torch.randint(3, 256, (2 * 9 + 1,), generator=g).tolist()
    want = make_engine(loaded).generate([prompt], PARAMS)[0].token_ids
    kv = prefill(source, prompt)
    if source.pool.in_place_updates:  # (Mamba1's layers, and states over pages, gather)
        assert in_place and max(held_at_flush, default=0) == 0
    else:
        assert max(held_at_flush) > 0, "the last chunk's state was not held"
    assert source.pool.held_rows_total == 0
    rid = decode.add_request(prompt, PARAMS, "d", output_ids=[kv["first"]], remote_kv=kv)
    assert drive(decode, loads, complete_all)[rid].token_ids == want


class StageRecorder(KeepAll):
    """Prefill side with staging: records what the engine publishes."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stage_begin(self, rid, token) -> None:
        self.events.append(("begin", rid, token))

    def stage_progress(self, rid, computed, block_ids) -> None:
        self.events.append(("progress", rid, computed, tuple(map(tuple, block_ids))))

    def stage_reset(self, rid) -> None:
        self.events.append(("reset", rid))

    def stage_end(self, rid) -> None:
        self.events.append(("end", rid))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_staged_prefill_publishes_its_progress_and_a_preemption_resets_it(checkpoint, arch):
    """The engine publishes a staged request's computed tokens and final blocks after every
    step (every full-attention block whose tokens are computed, a window's from the final
    window's first block); when a lease pins the pool and the request is preempted, it says
    so before anything can reuse the blocks, and the progress starts over; a request that
    ends without keeping its KV (aborted) is ended."""
    model, config, tok = load_model(checkpoint(arch))
    rec = StageRecorder()
    cfg = EngineConfig(kv_memory_bytes=2**18, max_num_batched_tokens=32)
    engine = Engine(model, config, cfg, tok, KVConnector(scheduler=rec))
    bs, usable = engine.kv.block_size, engine.kv.pool.num_blocks - 1
    length = (usable * 6 // 10) * bs  # two prompts do not fit together
    first, second = (prompt_of(engine, length // bs, seed) for seed in (1, 2))
    a = engine.add_request(first, PARAMS, remote_decode=True, stage_token="ta")
    b = engine.add_request(second, PARAMS, remote_decode=True, stage_token="tb")
    kept: dict[str, dict] = {}
    for _ in range(400):
        for out in engine.step():
            if out.finished:
                kept[out.request_id] = out.kv_transfer_params
        if a in kept and ("reset", b) in rec.events and engine.kv.has_request(a):
            engine.free_request_blocks(a)  # decode pulled it: the pool is free again
        if b in kept:
            break
    assert set(kept) == {a, b} and ("reset", b) in rec.events
    assert ("begin", a, "ta") in rec.events and ("begin", b, "tb") in rec.events
    # Per request, progress grows within an epoch and a reset starts it over; each
    # published block list extends the one before; the last one is what was kept (the
    # prompt is whole blocks).
    groups = engine.kv_config.groups
    for rid in (a, b):
        mine = [e for e in rec.events if e[1] == rid and e[0] in ("progress", "reset")]
        last, blocks = 0, tuple(() for _ in groups)
        for e in mine:
            if e[0] == "reset":
                last, blocks = 0, tuple(() for _ in groups)
                continue
            computed, published = e[2], e[3]
            assert computed > last
            for g, (ids, before) in enumerate(zip(published, blocks, strict=True)):
                assert ids[: len(before)] == before
                lead = groups[g].spec.first_needed_token(length) // bs
                assert len(ids) == max(0, computed // bs - lead)
            last, blocks = computed, published
        assert last == length and blocks == kept[rid]["blocks"]
    assert ("reset", a) not in rec.events
    # Aborted while staged: ended.
    c = engine.add_request(first[:40], PARAMS, remote_decode=True, stage_token="tc")
    engine.abort(c)
    assert rec.events[-1] == ("end", c)


class Staged(dict):
    """Params of a staged load (the prefill still runs): the first token comes with it."""

    staged = True


def test_a_staged_load_brings_the_first_token_or_fails_without_it(loaded):
    """Added without a first token, a staged request takes it from its load: on success it
    runs from prompt + that token; on a failed load that learned it, it recomputes after
    it; on a failed load that never learned it, it fails whatever its policy (recomputing
    would sample a first token of its own)."""
    source, decode, loads = pd_pair(loaded)
    prompt = prompt_of(source, 5, seed=11)
    want = make_engine(loaded).generate([prompt], PARAMS)[0].token_ids
    kv = Staged(prefill(source, prompt))

    def load_ends(error: str | None, first: int | None, copy: bool):
        def action(lo: ScriptedLoads) -> None:
            for rid in list(lo.started):
                if copy:
                    lo.complete(rid)
                    lo._done[-1] = LoadResult(rid, error, 1, 1, 0.0, first_token=first)
                else:
                    lo.started.pop(rid)
                    lo._done.append(LoadResult(rid, error, first_token=first))

        return action

    with pytest.raises(ValueError, match="exactly one token"):
        decode.add_request(prompt, PARAMS, "x", output_ids=[want[0]], remote_kv=kv)
    decode.add_request(prompt, PARAMS, "ok", remote_kv=kv)
    out = drive(decode, loads, load_ends(None, kv["first"], copy=True))["ok"]
    assert out.token_ids == want and not out.recomputed
    decode.add_request(prompt, PARAMS, "late", remote_kv=kv)
    out = drive(decode, loads, load_ends("peer died", kv["first"], copy=False))["late"]
    assert out.token_ids == want and out.recomputed
    decode.add_request(prompt, PARAMS, "blind", remote_kv=kv, on_load_failure="recompute")
    out = drive(decode, loads, load_ends("peer died", None, copy=False))["blind"]
    assert out.finish_reason == "error" and out.token_ids == []  # not recomputed
    assert out.error == "KV transfer failed: peer died"
    assert_clean(decode)
