"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step the scheduler spends a token budget: running requests first (a decode token, or
the next prefill chunk), then waiting requests in arrival order. When the pool cannot hold
a running request's next tokens, the most recently admitted request is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed (prompt + outputs so
far, so greedy output is unchanged).

A request whose prompt KV comes from a prefill worker (`request.remote_kv`) waits in the same
queue. At its turn it gets only the blocks later steps read (`allocate_external`) and moves to
`receiving` (WAITING_FOR_REMOTE_KV) while the connector fills them; `finish_load` then admits
it to `running`, or applies its failure policy (recompute the prompt here, or fail).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from hybrid_pd.engine.request import Request, Status
from hybrid_pd.kvcache.ids import BlockId, RequestId
from hybrid_pd.kvcache.manager import BlockIds, KVCacheManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 4096
    #: Keep a recurrent-state snapshot at the prompt's last block boundary, where later
    #: prompts can hit it: a chunk that passes the boundary writes the state there on its
    #: way (pages reserved for it); a chunk ends at the boundary only when the pool has no
    #: room for them.
    align_state_snapshots: bool = True
    #: A request whose prompt KV arrives from elsewhere first takes the blocks this pool
    #: already caches for its prompt (decode-side prefix reuse); only the rest is moved.
    reuse_prefix_on_load: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("scheduler limits must be positive (max_model_len >= 2)")


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_computed: int
    num_new: int
    block_ids: BlockIds
    #: (tokens into the chunk, pages per group): the states after that many tokens go to
    #: those pages, kept as the prefix cache's snapshot of the prompt's last block boundary.
    snapshot: tuple[int, BlockIds] | None = None

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens (a token is sampled)."""
        return self.num_computed + self.num_new == len(self.request.all_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    #: Requests that got blocks for their remote KV this step: the connector loads them
    #: (request, block ids, per group how many leading blocks were held here already).
    loads: list[tuple[Request, BlockIds, tuple[int, ...]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Blocks allocated, KV arriving (request id -> request). An aborted request stays
        #: here until its load ends: the connector may still be writing into its blocks.
        self.receiving: dict[str, Request] = {}
        self._has_state = any(g.is_state for g in kv.config.groups)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.receiving)

    @property
    def can_schedule(self) -> bool:
        """Whether `schedule` may do anything now (otherwise only a load ending, a new
        request or freed blocks change the picture)."""
        return bool(self.running or self.waiting)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError if a request can never run (too long, or larger than the pool)."""
        total = prompt_len + max_tokens
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"the model's maximum length of {self.config.max_model_len} tokens"
            )
        need = self.kv.config.blocks_per_request(total)
        have = self.kv.pool.num_blocks - 1
        if need > have:
            raise ValueError(
                f"a request of {total} tokens needs {need} KV blocks but the pool has only "
                f"{have}; raise --kv-memory or lower max_tokens"
            )

    def add(self, request: Request) -> None:
        self.check_fits(len(request.prompt_ids), request.params.max_tokens)
        self.waiting.append(request)

    def abort(self, rid: str, keep_cached: bool = True) -> Request | None:
        """Remove a request wherever it is and free its blocks (`keep_cached=False`: put
        nothing they hold into the prefix cache)."""
        for req in list(self.waiting):
            if req.request_id == rid:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return req
        for req in self.running:
            if req.request_id == rid:
                self.running.remove(req)
                self._finish(req, "abort", keep_cached=keep_cached)
                return req
        req = self.receiving.get(rid)
        if req is not None and not req.finished:
            # Its blocks are freed when the load ends (`finish_load`), never while written.
            req.status = Status.FINISHED
            req.finish_reason = "abort"
            return req
        return None

    def finish_load(
        self, rid: str, error: str | None, first_token: int | None = None
    ) -> Request | None:
        """A remote KV load ended. Success: the request runs from prompt + first token.
        Failure: its blocks are freed without caching anything they hold, then the request
        is recomputed from its prompt (ahead of the queue) or finished with `error`.
        A staged request (added without its first token) takes `first_token` from the load;
        when the load never learned it, the request fails whatever its policy (recomputing
        would sample a first token of its own, not the one the client has).
        Returns the request when it finished here (failed, or aborted meanwhile)."""
        req = self.receiving.pop(rid, None)
        if req is None:
            return None
        if req.finished:  # aborted while loading
            self.kv.free(RequestId(rid), keep_cached=False)
            return req
        if not req.output_ids:
            if first_token is None:
                error = error or "the load did not bring the first token"
                self.kv.free(RequestId(rid), keep_cached=False)
                return self._fail_load(req, error)
            req.all_ids.append(first_token)
            if req.logprobs is not None:
                req.logprobs.append(None)
        if error is None:
            self.kv.commit_computed(RequestId(rid), req.num_computed)
            req.remote_kv = None
            req.status = Status.RUNNING
            self.running.append(req)
            return None
        self.kv.free(RequestId(rid), keep_cached=False)
        req.remote_kv = None
        req.num_computed = 0
        if req.on_load_failure == "recompute":
            req.recomputed = True
            req.status = Status.WAITING
            self.waiting.appendleft(req)
            logger.warning("KV load of %s failed (%s): recomputing its prompt", rid, error)
            return None
        return self._fail_load(req, error)

    @staticmethod
    def _fail_load(req: Request, error: str) -> Request:
        req.remote_kv = None
        req.status = Status.FINISHED
        req.finish_reason = "error"
        req.error = f"KV transfer failed: {error}"
        return req

    def add_running(self, request: Request) -> None:
        """Admit a request whose blocks are already allocated and filled (KV received)."""
        request.status = Status.RUNNING
        self.running.append(request)

    def finish(self, req: Request, free_blocks: bool = True) -> None:
        """Retire a request. With `free_blocks=False` its blocks stay allocated under its
        id (a connector keeps them for a decode worker) until `kv.free` is called."""
        if req in self.running:
            self.running.remove(req)
        self._finish(req, req.finish_reason or "stop", free_blocks)

    def _finish(
        self, req: Request, reason: str, free_blocks: bool = True, keep_cached: bool = True
    ) -> None:
        req.status = Status.FINISHED
        req.finish_reason = req.finish_reason or reason
        if free_blocks:
            self.kv.free(RequestId(req.request_id), keep_cached=keep_cached)

    def _last_boundary(self, req: Request) -> int:
        """The prompt's last block boundary, where a state snapshot is kept; 0 when no
        snapshot is kept."""
        if not (self._has_state and self.config.align_state_snapshots and self.kv.enable_caching):
            return 0
        bs = self.kv.block_size
        return ((len(req.prompt_ids) - 1) // bs) * bs

    def _scheduled(self, req: Request, n: int, ids: BlockIds) -> ScheduledSeq:
        """The step for `n` tokens whose blocks are allocated: with pages reserved for the
        snapshot at a boundary inside it, or ended at that boundary when there is no room
        (the blocks allocated past it serve the next step)."""
        boundary = self._last_boundary(req)
        if not req.num_computed < boundary < req.num_computed + n:
            return ScheduledSeq(req, req.num_computed, n, ids)
        pages = self.kv.reserve_snapshots(RequestId(req.request_id), boundary)
        if pages is None:
            return ScheduledSeq(req, req.num_computed, boundary - req.num_computed, ids)
        return ScheduledSeq(req, req.num_computed, n, ids, (boundary - req.num_computed, pages))

    def _fit_alone(self, req: Request, n: int, hit) -> tuple[int, BlockIds | None]:
        """Halve a chunk until its blocks fit, for a request that has the pool to itself.

        A chunk needs blocks for all of its tokens at once, before a sliding-window layer
        can drop the ones that slid out, so one chunk may need more blocks than the whole
        request ever holds (`check_fits`). Waiting for blocks nobody will free would hang
        the request forever; a smaller chunk needs fewer."""
        rid = RequestId(req.request_id)
        ids = None
        while ids is None and n > 1:
            n //= 2
            ids = self.kv.allocate_slots(rid, req.all_ids, n, hit)
        return n, ids

    def _preempt(self, out: SchedulerOutput) -> Request:
        victim = self.running.pop()
        self.kv.free(RequestId(victim.request_id))
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim.request_id)
        logger.info("preempted %s (recompute)", victim.request_id)
        return victim

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        for req in list(self.running):
            if budget <= 0:
                break
            if req.request_id in out.preempted:
                continue  # preempted earlier in this loop (`in self.running` compared fields)
            n = min(req.num_uncomputed, budget)
            if n <= 0:
                continue
            rid = RequestId(req.request_id)
            while (ids := self.kv.allocate_slots(rid, req.all_ids, n)) is None:
                if n > 1 and self.running == [req] and not self.receiving:
                    n //= 2  # alone and still short: split the chunk (see _fit_alone)
                    continue
                victim = self._preempt(out)
                if victim is req:
                    break
                if victim.request_id in scheduled:
                    out.seqs = [s for s in out.seqs if s.request is not victim]
            if ids is None:
                continue
            seq = self._scheduled(req, n, ids)
            out.seqs.append(seq)
            scheduled.add(req.request_id)
            budget -= seq.num_new
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.receiving) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            rid = RequestId(req.request_id)
            if req.remote_kv is not None:  # blocks in turn; the connector fills them
                ids = self.kv.allocate_external(
                    rid, req.all_ids, len(req.prompt_ids), self.config.reuse_prefix_on_load
                )
                if ids is None:
                    break
                self.waiting.popleft()
                req.status = Status.WAITING_FOR_REMOTE_KV
                req.num_computed = len(req.prompt_ids)
                held = self.kv.num_held(rid)
                req.num_cached_tokens = self.kv.held_tokens(rid)
                self.receiving[req.request_id] = req
                out.loads.append((req, ids, held))
                continue
            hit = self.kv.find_prefix_hit(req.all_ids)
            if req.params.prompt_logprobs is not None:  # every prompt position is scored
                hit = self.kv.find_prefix_hit(())
            req.num_computed = hit.num_tokens
            n = min(req.num_uncomputed, budget)
            ids = self.kv.allocate_slots(rid, req.all_ids, n, hit)
            if ids is None and not self.running and not self.receiving:
                n, ids = self._fit_alone(req, n, hit)
            if ids is None:
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.num_cached_tokens = hit.num_tokens
            self.running.append(req)
            seq = self._scheduled(req, n, ids)
            out.seqs.append(seq)
            budget -= seq.num_new
        for seq in out.seqs:
            out.copies += self.kv.pending_state_copies(RequestId(seq.request.request_id))
        return out

    def commit(self, seq: ScheduledSeq) -> None:
        """The step ran: record the computed tokens (and keep a state snapshot at the
        prompt's last block boundary)."""
        req = seq.request
        req.num_computed = seq.num_computed + seq.num_new
        rid = RequestId(req.request_id)
        self.kv.commit_computed(rid, req.num_computed)
        if seq.snapshot is not None:
            self.kv.commit_snapshots(rid)
        if req.num_computed == self._last_boundary(req) > 0:
            self.kv.snapshot_states(rid)
