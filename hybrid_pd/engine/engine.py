"""The single-worker engine: scheduler + model + KV pool, driven step by step."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pd.connector.base import KVConnector
from hybrid_pd.engine import cpu_kernels
from hybrid_pd.engine.batch import make_batch
from hybrid_pd.engine.grammar import (
    Grammar,
    GrammarCache,
    advance_grammar,
    mask_logits,
    sync_grammar,
)
from hybrid_pd.engine.logprobs import logprobs_of, score_prompt
from hybrid_pd.engine.request import Request, Status
from hybrid_pd.engine.sampling import SamplingParams, catch_up, make_generator, sample
from hybrid_pd.engine.scheduler import Scheduler, SchedulerConfig
from hybrid_pd.engine.tp.group import SINGLE, TPGroup
from hybrid_pd.engine.tp.head import leader_logits
from hybrid_pd.engine.tp.steps import PoolShape, StepPlan
from hybrid_pd.kvcache.config import KVCacheConfig
from hybrid_pd.kvcache.grouping import plan_groups
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.ids import RequestId
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.pool import KVPool, num_blocks_for_memory
from hybrid_pd.kvcache.tp_layout import TP_CONFIG_KEY, rank_kv_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    kv_memory_bytes: int = 256 * 2**20
    block_size: int | None = None
    kv_dtype: str | None = None  # default: the model's dtype
    enable_prefix_caching: bool = True
    #: Decode role: pull only the prompt blocks this pool does not cache already.
    reuse_prefix_on_load: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's maximum, capped at 32768
    #: Memory for the decode rows' states kept between steps so that a steady batch
    #: neither gathers nor scatters them (KVPool held rows); default a quarter of
    #: kv_memory_bytes, at most 1 GiB; 0 turns it off.
    held_state_rows_bytes: int | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int = 0
    text: str | None = None
    kv_transfer_params: dict | None = None
    #: Decode role: how the prompt's KV arrived (connector.base.LoadResult), or None.
    load_result: Any = None
    #: Decode role: the load failed and the prompt was computed here instead.
    recomputed: bool = False
    #: Set when the request failed (finish_reason "error").
    error: str | None = None
    #: When the sampling params ask for them (see Request.logprobs / prompt_logprobs).
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class Engine:
    """Runs one model on one device. Not thread-safe: drive it from one thread."""

    def __init__(
        self,
        model,
        hf_config: dict,
        config: EngineConfig,
        tokenizer=None,
        connector: KVConnector | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        """`connector.scheduler` (prefill role): requests added with `remote_decode=True`
        stop after their first token and hand their KV to it. `connector.worker` (decode
        role): requests added with `remote_kv` get their prompt's KV loaded through it.

        `tp`: this engine is rank 0 of a tensor-parallel group (`model` and `hf_config`
        are its shard and rank config); the other ranks run `engine.tp.follower.Follower`
        and take every step this engine announces. Held state rows are off then (a
        follower's pool has no allocator to tell it when to write them back)."""
        if not tp.is_leader:
            raise ValueError("an Engine runs on rank 0; other ranks run a Follower")
        self.tp = tp
        if tp.size > 1:
            config = dataclasses.replace(config, held_state_rows_bytes=0)
        self.model = model
        self.connector = connector or KVConnector()
        self.tokenizer = tokenizer
        self.config = config
        param = next(model.parameters())
        self.device = param.device
        if self.device.type == "cpu":
            cpu_kernels.library()  # built (or refused, logged) now, not at the first prompt
        self.kv_config, max_len = plan_kv_cache(model, hf_config, config)
        self.max_model_len = max_len
        num_blocks = num_blocks_for_memory(self.kv_config, config.kv_memory_bytes)
        self.kv = KVCacheManager(self.kv_config, num_blocks, config.enable_prefix_caching)
        self.pool = KVPool(
            self.kv_config,
            num_blocks,
            device=self.device,
            held_rows_bytes=config.held_state_rows_bytes,
        )
        self.pool.hold_rows_for(self.kv.pool)
        tp.broadcast(PoolShape.of(self.pool))  # the followers check theirs against it
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                max_len,
                reuse_prefix_on_load=config.reuse_prefix_on_load,
            ),
            self.kv,
        )
        self.eos_token_ids = _eos_ids(hf_config, tokenizer)
        self.vocab_size = int((hf_config.get("text_config") or hf_config)["vocab_size"])
        self.grammars = GrammarCache(
            getattr(tokenizer, "to_json", None), self.vocab_size, self.eos_token_ids
        )
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}
        #: Steps that changed something (ran the model, started or ended a load).
        self.num_steps_with_work = 0

    # -- request API ------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        remote_decode: bool = False,
        output_ids: Sequence[int] = (),
        remote_kv: Any = None,
        on_load_failure: str = "recompute",
        stage_token: str | None = None,
        grammar: Grammar | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and queues nothing) if it can never run.

        `output_ids`: tokens already generated elsewhere (the first token sampled by a
        prefill worker, or a migrated stream's tokens); they count toward max_tokens.
        Without `remote_kv` they are recomputed with the prompt. With `remote_kv` (decode
        role) the prompt's KV is loaded through the connector's worker side when the
        request's turn comes, and decoding continues after `output_ids` (the first token);
        if the load fails, `on_load_failure` says whether to recompute or fail. Staged
        `remote_kv` (the prefill still runs) comes without the first token: the load
        brings it.

        `stage_token` (prefill role, with `remote_decode`): a decode worker showing this
        token may follow the prefill and pull its computed blocks while it runs; the kept
        KV's transfer token is this one.

        `grammar`: the params' constraint compiled already (`self.grammars.compile`, which
        a worker calls off the engine thread); without it a constrained request is
        compiled here. The request's matcher replays `output_ids` (ValueError when they
        break the constraint).
        """
        req = self._new_request(prompt_ids, params, request_id, output_ids)
        if params.constraint is not None:
            if grammar is None or grammar.constraint != params.constraint:
                grammar = self.grammars.compile(params.constraint)
            req.matcher = grammar.matcher()
            if not sync_grammar(req):
                raise ValueError("the tokens already generated do not match the constraint")
        if remote_decode and self.connector.scheduler is None:
            raise ValueError("remote_decode needs an engine with a prefill connector")
        if stage_token and not (remote_decode and hasattr(self.connector.scheduler, "stage_begin")):
            raise ValueError("a transfer token needs remote_decode and a staging connector")
        if remote_kv is not None:
            if self.connector.worker is None:
                raise ValueError("remote KV needs an engine with a decode connector")
            if len(output_ids) != (0 if getattr(remote_kv, "staged", False) else 1):
                raise ValueError(
                    "a request with remote KV starts from exactly one token "
                    "(none while its prefill is staged)"
                )
            if on_load_failure not in ("recompute", "fail"):
                raise ValueError("failure policy must be 'recompute' or 'fail'")
            req.remote_kv = remote_kv
            req.on_load_failure = on_load_failure
        req.remote_decode = remote_decode
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        if stage_token:
            req.stage_token = stage_token
            self.connector.scheduler.stage_begin(req.request_id, stage_token)
        return req.request_id

    def _new_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None,
        output_ids: Sequence[int] = (),
    ) -> Request:
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests or self.kv.has_request(RequestId(rid)):
            raise ValueError(f"request id {rid!r} is already in use")
        vocab = self.vocab_size
        if any(not 0 <= int(t) < vocab for t in [*prompt_ids, *output_ids]):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(output_ids) >= params.max_tokens:
            raise ValueError("the request already has max_tokens output tokens")
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)
        prompt = [int(t) for t in prompt_ids]
        req = Request(rid, prompt, params, self.eos_token_ids)
        req.all_ids = prompt + [int(t) for t in output_ids]
        req.generator = make_generator(params, self.device)
        if params.logprobs is not None:
            req.logprobs = [None] * len(output_ids)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt)
        return req

    def free_request_blocks(self, request_id: str) -> None:
        """Free blocks a connector kept for a handed-over request (safe to call twice)."""
        self.kv.free(RequestId(request_id))

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is; returns it (None when unknown or finished)."""
        req = self.scheduler.abort(request_id)
        self._unstage(self.requests.pop(request_id, None))
        return req

    def fail_all(self) -> list[str]:
        """A step raised: drop every request it may have touched, caching nothing their
        pages hold (a state page may be half advanced). Returns their ids."""
        failed = list(self.requests)
        for rid in failed:
            self.scheduler.abort(rid, keep_cached=False)
            self._unstage(self.requests.pop(rid))
        return failed

    def _unstage(self, req: Request | None) -> None:
        """A staged prefill ends without keeping its KV: decode must stop following it."""
        if req is not None and req.stage_token:
            self.connector.scheduler.stage_end(req.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def can_step(self) -> bool:
        """Whether a step may make progress now (else wait for a load, a new request, or
        blocks freed elsewhere)."""
        return self.scheduler.can_schedule or self.loads_ended()

    def loads_ended(self) -> bool:
        """Whether the connector has KV loads to report (cheap)."""
        worker = self.connector.worker
        return worker is not None and worker.has_finished()

    # -- the loop ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Take ended KV loads, schedule, start new loads, run the model once, sample.
        Returns outputs of requests that got a token or finished (a failed load)."""
        ended, outputs = self._take_finished_loads()
        sched = self.scheduler.schedule()
        for req, ids, held in sched.loads:
            self.connector.worker.start_load_kv(req.request_id, req.remote_kv, ids, held)
        for rid in sched.preempted:  # before this step's model run can reuse their blocks
            if getattr(self.requests.get(rid), "stage_token", None):
                self.connector.scheduler.stage_reset(rid)
        if ended or sched.loads or sched.seqs or sched.preempted:
            self.num_steps_with_work += 1
        if not sched.seqs:
            return outputs
        copies = [(int(s), int(d)) for s, d in sched.copies]
        self.pool.copy_blocks(copies)
        for seq in sched.seqs:
            self.kv.finish_state_copies(RequestId(seq.request.request_id))
        seqs = [
            (
                s.request.request_id,
                s.request.all_ids[s.num_computed : s.num_computed + s.num_new],
                s.num_computed,
                s.block_ids,
                s.snapshot,
            )
            for s in sched.seqs
        ]
        if self.tp.size > 1:
            self.tp.broadcast(StepPlan(copies, seqs))
        batch = make_batch(self.pool, seqs)
        hidden = self.model(batch)
        head = functools.partial(leader_logits, self.model, self.tp, hidden)
        for seq, info in zip(sched.seqs, batch.seqs, strict=True):
            if seq.request.prompt_logprobs is not None:
                score_prompt(head, info, seq.request)
        sampling = [i for i, s in enumerate(sched.seqs) if s.samples]
        tokens: list[int] = []
        scored: dict[int, object] = {}
        if sampling:
            last = batch.last_token_indices()[sampling]
            logits = head(last.tolist()).float()
            reqs = [sched.seqs[i].request for i in sampling]
            constrained = [j for j, r in enumerate(reqs) if r.matcher is not None]
            picked = logits
            if constrained:  # the raw logits stay for logprobs
                picked = mask_logits(logits, constrained, [reqs[j].matcher for j in constrained])
            catch_up(reqs, picked)  # seeded requests resuming after tokens sampled elsewhere
            tokens = sample(picked, [r.params for r in reqs], [r.generator for r in reqs])
            rows = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
            if rows:
                values = logprobs_of(
                    logits[rows], [tokens[j] for j in rows], [reqs[j].params.logprobs for j in rows]
                )
                scored = dict(zip(rows, values, strict=True))
        for seq in sched.seqs:
            self.scheduler.commit(seq)
            req = seq.request
            if req.stage_token:
                computed = min(req.num_computed, len(req.prompt_ids))
                self.connector.scheduler.stage_progress(
                    req.request_id, computed, self._final_blocks(req, computed)
                )
        for j, (i, token) in enumerate(zip(sampling, tokens, strict=True)):
            req = sched.seqs[i].request
            req.append_token(token, scored.get(j))
            self._check_stop_strings(req)
            if req.matcher is not None:
                advance_grammar(req)
            if req.finish_reason is None and req.remote_decode:
                self._hand_over(req)
            elif req.finish_reason is not None:
                self._unstage(req)
                self.scheduler.finish(req)
                self.requests.pop(req.request_id, None)
            outputs.append(self._output(req))
        return outputs

    def _final_blocks(self, req: Request, computed: int) -> tuple[tuple[int, ...], ...]:
        """A staged request's blocks whose KV is final after `computed` prompt tokens, per
        group, in the order the handed-over KV will list them: the attention blocks the
        end of the prompt still reads (from the first needed one) whose tokens are all
        computed; no state pages (the state advances until the prompt ends)."""
        bs = self.kv.block_size
        done = computed // bs
        out = []
        for group, ids in zip(
            self.kv_config.groups, self.kv.block_ids(RequestId(req.request_id)), strict=True
        ):
            first = group.spec.first_needed_token(len(req.prompt_ids)) // bs
            out.append(() if group.spec.kind == "state" else tuple(ids[first:done]))
        return tuple(out)

    def _hand_over(self, req: Request) -> None:
        """Prefill role: the first token is sampled; keep the KV for a decode worker."""
        rid = RequestId(req.request_id)
        self.kv.release_out_of_window(rid)
        # states held by the pool reach the pages the decode worker reads
        self.pool.flush_rows([b for group in self.kv.block_ids(rid) for b in group])
        keep, params = self.connector.scheduler.request_finished_all_groups(
            req, self.kv.block_ids(rid)
        )
        req.finish_reason = "remote_decode"
        req.kv_transfer_params = params
        self.scheduler.finish(req, free_blocks=not keep)
        self.requests.pop(req.request_id, None)

    def _take_finished_loads(self) -> tuple[int, list[RequestOutput]]:
        """Apply ended loads; returns how many ended and the outputs of requests that
        finished because of it (failed under policy "fail")."""
        worker = self.connector.worker
        if worker is None:
            return 0, []
        outputs = []
        results = worker.get_finished()
        for res in results:
            req = self.scheduler.receiving.get(res.request_id)
            if req is not None:
                req.load_result = res
            done = self.scheduler.finish_load(res.request_id, res.error, res.first_token)
            if req is not None and req.matcher is not None and done is None:
                sync_grammar(req)  # a staged load brought the first token
            if done is not None:
                self.requests.pop(done.request_id, None)
                if done.finish_reason == "error":
                    outputs.append(self._output(done))
        return len(results), outputs

    def _check_stop_strings(self, req: Request) -> None:
        if not req.params.stop or self.tokenizer is None or req.finish_reason:
            return
        text = self.tokenizer.decode(req.output_ids)
        if any(s in text for s in req.params.stop):
            req.finish_reason = "stop"

    def _output(self, req: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None and req.finished:
            text = self.tokenizer.decode(req.output_ids)
            for s in req.params.stop:
                cut = text.find(s)
                if cut >= 0:
                    text = text[:cut]
        return RequestOutput(
            req.request_id,
            req.prompt_ids,
            list(req.output_ids),
            req.status is Status.FINISHED,
            req.finish_reason,
            req.num_cached_tokens,
            text,
            req.kv_transfer_params,
            req.load_result,
            req.recomputed,
            req.error,
            None if req.logprobs is None else list(req.logprobs),
            req.prompt_logprobs,
        )

    def generate(
        self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run prompts (token ids, or text when a tokenizer is loaded) to completion."""
        params = params or SamplingParams()
        rids = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer")
                p = self.tokenizer.encode(p)
            rids.append(self.add_request(p, params))
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in rids]

    def release_followers(self) -> None:
        """Tell the other ranks of the group that no step follows (their `run` returns).
        Call once, when the engine is done; nothing with one rank."""
        if self.tp.size > 1:
            self.tp.broadcast(None)


def plan_kv_cache(model, hf_config: dict, config: EngineConfig) -> tuple[KVCacheConfig, int]:
    """The KV cache groups an engine of `model` will use, and its maximum length (a
    worker needs them for its connector before the engine exists)."""
    groups, _, max_len = plan_kv_caches(model, hf_config, config)
    return groups, max_len


def plan_kv_caches(
    model, hf_config: dict, config: EngineConfig
) -> tuple[KVCacheConfig, KVCacheConfig | None, int]:
    """`plan_kv_cache`'s groups, the whole model's grouping when `hf_config` is a
    tensor-parallel rank's (the groups are then that grouping with the rank's slots,
    `kvcache.tp_layout`; None for a single-rank model), and the maximum length."""
    dtype = config.kv_dtype or _dtype_name(next(model.parameters()))
    spec = cache_spec_from_config(hf_config, dtype=dtype)
    max_len = config.max_model_len or min(spec.max_model_len or 4096, 32768)
    tp = hf_config.get(TP_CONFIG_KEY)
    if tp is None:
        return plan_groups(spec, block_size=config.block_size, ref_len=max_len), None, max_len
    whole = cache_spec_from_config(tp["config"], dtype=dtype)
    full = plan_groups(whole, block_size=config.block_size, ref_len=max_len)
    return rank_kv_config(full, spec), full, max_len


def _dtype_name(param: torch.Tensor) -> str:
    return str(param.dtype).removeprefix("torch.")


def _eos_ids(hf_config: dict, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        eos = cfg.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
