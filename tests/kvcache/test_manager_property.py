"""Stateful property test of KVCacheManager over a full + sliding window + state model.

The machine plays the engine: it "writes" a label into every block it computes (the token
prefix the block's KV, or the state, stands for), checks that a prefix hit only hands out
blocks whose label matches the new request's tokens and that nobody overwrote a live
request's blocks, and predicts every allocation's block count (refused iff short). After
every step: integrity, block ownership, no leak, per-group list lengths and null prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybrid_pd.kvcache.config import KVCacheConfig, KVCacheGroup, align_up, slot_bytes_for
from hybrid_pd.kvcache.grouping import plan_groups
from hybrid_pd.kvcache.ids import BlockId
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.specs import (
    FullAttentionSpec,
    ModelCacheSpec,
    SlidingWindowSpec,
    cdiv,
    gdn_state_spec,
)
from tests.kvcache.kv_checks import check

FA = FullAttentionSpec(1, 4, "float32")
SW = SlidingWindowSpec(1, 4, "float32", window=24)
ST = gdn_state_spec(
    num_k_heads=1,
    num_v_heads=1,
    head_k_dim=2,
    head_v_dim=2,
    conv_kernel=2,
    conv_dtype="float32",
    ssm_dtype="float32",
)
MODEL = ModelCacheSpec(
    "tiny3", {"f0": FA, "s0": SW, "g0": ST, "s1": SW, "f1": FA, "s2": SW, "g1": ST}
)
#: Prompts start with a prefix of one of these, so requests share blocks.
STEMS = [[(i * 7 + 3 * s + i // 5) % 3 for i in range(40)] for s in range(2)]


def three_group_config(bs: int, span: int, order: list[int]) -> KVCacheConfig:
    """One group per type (full, SW, state) in the given order; state spread over `span`."""
    slot_a, slot_s = slot_bytes_for(FA, bs), slot_bytes_for(ST, bs, span)
    parts = [
        (FA, ("f0", "f1"), slot_a, 1),
        (SW, ("s0", "s1", "s2"), slot_a, 1),
        (ST, ("g0", "g1"), slot_s, span),
    ]
    groups = tuple(KVCacheGroup(i, *parts[k]) for i, k in enumerate(order))
    return KVCacheConfig(bs, align_up(max(3 * slot_a, 2 * slot_s)), groups)


@dataclass
class Req:
    tokens: list[int]
    computed: int
    scheduled: int  # allocated, not yet computed
    slots: int  # tokens the request holds slots for
    released_at: int  # num_computed at the last release of out-of-window blocks


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        bs=st.integers(4, 8),
        kind=st.sampled_from(["three", "three", "planned"]),
        span=st.integers(1, 2),
        order=st.sampled_from([[2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]),
        extra=st.integers(0, 24),
    )
    def setup(self, bs: int, kind: str, span: int, order: list[int], extra: int) -> None:
        if kind == "planned":  # 6 or 7 groups, states over 1 to 3 blocks
            config, num_blocks = plan_groups(MODEL, block_size=bs, ref_len=64), 36 + extra
        else:
            config, num_blocks = three_group_config(bs, span, order), 16 + extra
        self.mgr = KVCacheManager(config, num_blocks)
        self.B = bs
        self.reqs: dict[str, Req] = {}
        self.labels: dict[int, tuple] = {}
        self.next_id = 0

    # -- engine model ---------------------------------------------------------------------
    def _label_ok(self, bid: int, expected: tuple) -> None:
        got = self.labels.get(bid)
        assert got == expected, f"block {bid} holds {got}, expected {expected}"

    def _groups(self, rid: str) -> list:
        ids = self.mgr.block_ids(rid)
        return [(g, m, ids[g]) for g, m in enumerate(self.mgr.managers)]

    def _pick(self, i: int) -> str | None:
        """A live request (None if there is none: the rule is then a no-op)."""
        return sorted(self.reqs)[i % len(self.reqs)] if self.reqs else None

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _run(self, rid: str) -> None:
        """The engine runs the pending copies, then computes the scheduled tokens."""
        r = self.reqs[rid]
        for src, dst in self.mgr.pending_state_copies(rid):
            self.labels[dst] = self.labels[src]
        self.mgr.finish_state_copies(rid)
        new = r.computed + r.scheduled
        for g, m, ids in self._groups(rid):
            if m.group.is_state:
                for j, bid in enumerate(ids):
                    self.labels[bid] = ("state", g, j, tuple(r.tokens[:new]))
                continue
            for i in range(r.computed // self.B, cdiv(new, self.B)):
                assert ids[i] != 0, f"group {g}: computing into the null block"
                self.labels[ids[i]] = ("kv", g, tuple(r.tokens[: min((i + 1) * self.B, new)]))
        self.mgr.commit_computed(rid, new)
        r.computed, r.scheduled = new, 0

    def _submit(self, tokens: list[int], chunk: int, run_now: bool) -> None:
        """A new request: prefix hit (checked against the labels), then allocate."""
        hit = self.mgr.find_prefix_hit(tokens)
        h = hit.num_tokens
        assert h % self.B == 0 and h < len(tokens)
        for g, (m, blocks) in enumerate(zip(self.mgr.managers, hit.blocks, strict=True)):
            if m.group.is_state:
                assert len(blocks) == (m.group.blocks_per_state if h else 0)
                for j, b in enumerate(blocks):
                    self._label_ok(b.block_id, ("state", g, j, tuple(tokens[:h])))
                continue
            assert len(blocks) == h // self.B
            for i, b in enumerate(blocks):
                if not b.is_null:
                    self._label_ok(b.block_id, ("kv", g, tuple(tokens[: (i + 1) * self.B])))
        rid, n = self._new_id(), min(chunk, len(tokens) - h)
        free = self.mgr.pool.num_free_blocks
        taken = {b.block_id for bl in hit.blocks for b in bl if not b.is_null and b.ref_cnt == 0}
        need = len(taken) + sum(
            m.group.blocks_per_state if m.group.is_state else cdiv(h + n, self.B) - h // self.B
            for m in self.mgr.managers
        )
        ids = self.mgr.allocate_slots(rid, tokens, n, hit)
        assert (ids is None) == (need > free), f"need {need}, free {free}"
        if ids is None:
            assert not self.mgr.has_request(rid) and self.mgr.pool.num_free_blocks == free
            return
        assert self.mgr.pool.num_free_blocks == free - need
        assert self.mgr.num_computed(rid) == h
        self.reqs[rid] = Req(tokens, h, n, h + n, h)
        if run_now:
            self._run(rid)

    def _step(self, rid: str, n: int, run_now: bool) -> bool:
        """Schedule `n` more tokens of a live request; predict the pool's block count."""
        r = self.reqs[rid]
        before = self.mgr.block_ids(rid)
        free, need = self.mgr.pool.num_free_blocks, 0
        for m, ids in zip(self.mgr.managers, before, strict=True):
            if not m.group.is_state:
                first = m.first_needed_block(r.computed)
                refs = [self.mgr.pool.get_block(BlockId(b)).ref_cnt for b in ids[:first] if b]
                free += refs.count(1)  # released blocks no other request holds
                need += max(0, cdiv(r.computed + n, self.B) - len(ids))
        got = self.mgr.allocate_slots(rid, r.tokens, n)
        r.released_at = r.computed
        assert (got is None) == (need > free), f"need {need}, free {free}"
        if got is None:  # unchanged, bar the blocks released out of the window
            assert self.mgr.pool.num_free_blocks == free
            after = self.mgr.block_ids(rid)
            for m, old, new in zip(self.mgr.managers, before, after, strict=True):
                first = 0 if m.group.is_state else m.first_needed_block(r.computed)
                assert len(old) == len(new)
                for i, (o, b) in enumerate(zip(old, new, strict=True)):
                    assert b == o or (b == 0 and i < first)
            return False
        assert self.mgr.pool.num_free_blocks == free - need
        r.scheduled, r.slots = n, max(r.slots, r.computed + n)
        if run_now:
            self._run(rid)
        return True

    # -- rules ----------------------------------------------------------------------------
    @rule(
        stem=st.integers(0, 1),
        k=st.integers(0, 40),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        chunk=st.integers(1, 48),
        aligned=st.booleans(),
        run_now=st.booleans(),
    )
    def new_request(
        self, stem: int, k: int, tail: list[int], chunk: int, aligned: bool, run_now: bool
    ) -> None:
        if aligned:  # block-aligned prompts and chunks make snapshots (state hits) likely
            k, chunk = k // self.B * self.B, max(chunk // self.B, 1) * self.B
        self._submit(STEMS[stem][:k] + tail, chunk, run_now)

    @rule(tok=st.integers(3, 5))
    def fill(self, tok: int) -> None:
        """A new request as long as the pool allows: leaves the free queue (nearly) empty."""
        rid, tokens = self._new_id(), [tok] * 64
        for n in range(64, 0, -1):
            if self.mgr.allocate_slots(rid, tokens, n) is not None:
                self.reqs[rid] = Req(tokens, 0, n, n, 0)
                return

    @rule(i=st.integers(0, 99), tok=st.integers(0, 2))
    def restart(self, i: int, tok: int) -> None:
        """Preempt a request on a block boundary and submit its tokens again: with a busy
        pool its own freed blocks sit at the head of the free queue as it takes them."""
        rid = self._pick(i)
        if rid is None:
            return
        r = self.reqs[rid]
        if r.scheduled:
            self._run(rid)
        boundary = cdiv(r.computed, self.B) * self.B
        r.tokens.extend([tok] * (boundary + 1 - len(r.tokens)))
        if boundary > r.computed and not self._step(rid, boundary - r.computed, True):
            return
        del self.reqs[rid]
        self.mgr.free(rid)
        self._submit(list(r.tokens), len(r.tokens), True)

    @rule(
        i=st.integers(0, 99),
        chunk=st.integers(1, 16),
        tok=st.integers(0, 2),
        aligned=st.booleans(),
        run_now=st.booleans(),
    )
    def append(self, i: int, chunk: int, tok: int, aligned: bool, run_now: bool) -> None:
        """A prefill chunk or a decode step (the sampled token becomes the next input)."""
        rid = self._pick(i)
        if rid is None:
            return
        r = self.reqs[rid]
        if r.scheduled:
            self._run(rid)
        if r.computed == len(r.tokens):
            r.tokens.append(tok)
        if aligned:  # up to the next block boundary, or beyond it by whole blocks
            chunk = (r.computed // self.B + max(1, chunk // self.B)) * self.B - r.computed
        self._step(rid, min(chunk, len(r.tokens) - r.computed), run_now)

    @rule(i=st.integers(0, 99))
    def snapshot(self, i: int) -> None:
        rid = self._pick(i)
        if rid is None:
            return
        r = self.reqs[rid]
        if r.scheduled:
            self._run(rid)
        before = self.mgr.block_ids(rid)
        done = self.mgr.snapshot_states(rid)
        if r.computed % self.B or r.computed == 0:
            assert not done and self.mgr.block_ids(rid) == before
        if done:  # the old pages are the snapshot, the request moves to fresh ones
            old = {b for g, m, _ in self._groups(rid) if m.group.is_state for b in before[g]}
            assert {s for s, _ in self.mgr.pending_state_copies(rid)} == old

    @rule(i=st.integers(0, 99), abort=st.booleans(), twice=st.booleans())
    def free(self, i: int, abort: bool, twice: bool) -> None:
        """Finish (after the step ran) or abort (possibly mid-step, copies pending)."""
        rid = self._pick(i)
        if rid is None:
            return
        if self.reqs[rid].scheduled and not abort:
            self._run(rid)
        del self.reqs[rid]
        self.mgr.free(rid)
        if twice:
            self.mgr.free(rid)

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        check(self.mgr)  # integrity, ownership, private state pages, no leak when idle
        assert self.mgr.num_requests == len(self.reqs)
        for rid, r in self.reqs.items():
            assert self.mgr.num_computed(rid) == r.computed
            pending = bool(self.mgr.pending_state_copies(rid))
            for g, m, ids in self._groups(rid):
                if m.group.is_state:
                    assert len(ids) == m.group.blocks_per_state and 0 not in ids
                    if not pending and r.computed:
                        for j, bid in enumerate(ids):
                            self._label_ok(bid, ("state", g, j, tuple(r.tokens[: r.computed])))
                    continue
                assert len(ids) == cdiv(r.slots, self.B)
                first = min(m.first_needed_block(r.released_at), len(ids))
                assert all(b == 0 for b in ids[:first]) and 0 not in ids[first:]
                for i in range(first, cdiv(r.computed, self.B)):
                    end = min((i + 1) * self.B, r.computed)
                    self._label_ok(ids[i], ("kv", g, tuple(r.tokens[:end])))


ManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerMachine = ManagerMachine.TestCase
