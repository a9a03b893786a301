"""Run one of our models on the real paged pool, step by step, for parity tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_pd.engine.batch import make_batch
from hybrid_pd.kvcache.grouping import plan_groups
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from hybrid_pd.kvcache.manager import KVCacheManager
from hybrid_pd.kvcache.pool import KVPool


class PagedRunner:
    """A model plus a KV cache manager and pool; greedy generation with chunked prefill."""

    def __init__(
        self,
        model,
        hf_config: dict,
        *,
        block_size: int = 4,
        num_blocks: int = 512,
        kv_dtype: str = "float32",
        device: str | torch.device | None = None,
        enable_caching: bool = True,
    ) -> None:
        spec = cache_spec_from_config(hf_config, dtype=kv_dtype)
        self.config = plan_groups(spec, block_size=block_size, ref_len=256)
        self.mgr = KVCacheManager(self.config, num_blocks, enable_caching)
        self.pool = KVPool(self.config, num_blocks, device=device)
        self.model = model

    @torch.no_grad()
    def step(self, work: Sequence[tuple[str, list[int], list[int]]]) -> torch.Tensor:
        """One forward over several requests: (request id, all tokens so far, new tokens).
        Returns float32 logits of each request's last new token, [len(work), vocab]."""
        seqs = []
        for rid, tokens, new in work:
            hit = None
            if not self.mgr.has_request(rid):
                hit = self.mgr.find_prefix_hit(tokens)
                if hit.num_tokens:
                    new = tokens[hit.num_tokens :]
            computed = (
                self.mgr.num_computed(rid)
                if self.mgr.has_request(rid)
                else (hit.num_tokens if hit else 0)
            )
            ids = self.mgr.allocate_slots(rid, tokens, len(new), hit)
            assert ids is not None, "pool too small for the test"
            self.pool.copy_blocks(self.mgr.pending_state_copies(rid))
            self.mgr.finish_state_copies(rid)
            seqs.append((rid, list(new), computed, ids))
        batch = make_batch(self.pool, seqs)
        hidden = self.model(batch)
        logits = self.model.compute_logits(hidden[batch.last_token_indices()])
        for rid, new, computed, _ in seqs:
            self.mgr.commit_computed(rid, computed + len(new))
        return logits.float()

    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new: int,
        chunk: int | None = None,
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy tokens per prompt (batched decode) and each prompt's first-step logits."""
        # One list per request, grown in place: the manager keeps a reference to the list it
        # is first given and hashes (for the prefix cache) the tokens appended to it later.
        tokens: list[list[int]] = [[] for _ in prompts]
        rids = [f"req{i}-{id(self)}" for i in range(len(prompts))]
        first_logits: list[torch.Tensor] = [None] * len(prompts)  # type: ignore[list-item]
        done = [0] * len(prompts)
        while any(done[i] < len(p) for i, p in enumerate(prompts)):  # chunked prefill
            work = []
            for i, p in enumerate(prompts):
                if done[i] < len(p):
                    n = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                    work.append((i, p[done[i] : done[i] + n]))
            for i, new in work:
                tokens[i].extend(new)
            logits = self.step([(rids[i], tokens[i], new) for i, new in work])
            for (i, new), row in zip(work, logits, strict=True):
                done[i] += len(new)
                if done[i] == len(prompts[i]):
                    first_logits[i] = row
                    tokens[i].append(int(row.argmax()))
        for _ in range(max_new - 1):
            logits = self.step([(rids[i], tokens[i], tokens[i][-1:]) for i in range(len(prompts))])
            for i, row in enumerate(logits):
                tokens[i].append(int(row.argmax()))
        for rid in rids:
            self.mgr.free(rid)
        self.mgr.check_integrity()
        return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)], first_logits


def mixed_step(model, config):
    """Two steps of a PagedRunner: a and b prefill, then a and b decode one token each with
    c's prefill between them (token rows 0 and 5 decode). Returns (the second step's
    ForwardBatch, the runner), for checks of what one step builds once and shares."""
    from tests.engine.mamba2_parity import prompt

    runner = PagedRunner(model, config)
    seen = []

    class Recorder:
        def __call__(self, batch):
            seen.append(batch)
            return model(batch)

        def compute_logits(self, hidden):
            return model.compute_logits(hidden)

    runner.model = Recorder()
    a, b, c = prompt(3, 1), prompt(5, 2), prompt(4, 3)
    runner.step([("a", a, a), ("b", b, b)])
    a.append(7)
    b.append(9)
    runner.step([("a", a, [7]), ("c", c, c), ("b", b, [9])])
    return seen[-1], runner


#: The step each request of `staggered` joins at, and its prefill chunk (9 tokens end with a
#: 1-token chunk on top of computed state).
STARTS = (0, 0, 1, 3, 6)
CHUNK = 8


def staggered(runner: PagedRunner, prompts, max_new: int):
    """Request i joins at step STARTS[i], prefills CHUNK tokens a step, then decodes one
    token a step, so most steps mix fresh prompts, prefill chunks and decodes. Returns the
    greedy tokens per request, every step's logits, and how many steps mixed one-token and
    longer sequences."""
    import torch

    rids = [f"req{i}-{id(runner)}" for i in range(len(prompts))]
    tokens: list[list[int]] = [[] for _ in prompts]  # grown in place (see PagedRunner)
    out: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    logits, mixed, step = [], 0, 0
    while any(len(o) < max_new for o in out):
        work = []
        for i, p in enumerate(prompts):
            if step < STARTS[i] or len(out[i]) >= max_new:
                continue
            new = p[done[i] : done[i] + CHUNK] if done[i] < len(p) else out[i][-1:]
            done[i] = min(len(p), done[i] + CHUNK)
            tokens[i].extend(new)
            work.append((i, new))
        mixed += {len(new) == 1 for _, new in work} == {True, False}
        rows = runner.step([(rids[i], tokens[i], new) for i, new in work])
        for (i, _), row in zip(work, rows, strict=True):
            logits.append(row)
            if done[i] == len(prompts[i]):
                out[i].append(int(row.argmax()))
        step += 1
    for rid in rids:
        runner.mgr.free(rid)
    runner.mgr.check_integrity()
    return out, torch.stack(logits), mixed
