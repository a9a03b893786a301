"""Shared checks of the Mamba2 hybrids (Bamba, Nemotron-H) against transformers.

The checkpoint (tests/checkpoints.py) is loaded through our loader and through transformers;
greedy tokens (batched, chunked prefill across Mamba2 chunk boundaries, prefix-cache hits)
must equal transformers' `generate`, and the first-step logits agree within TOL (float32).
"""

from __future__ import annotations

import torch
import transformers

from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.sampling import SamplingParams
from tests.engine.harness import PagedRunner

NEW = 24
TOL = 1e-4
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


class Reference:
    """transformers on the same checkpoint folder: greedy tokens and last-position logits."""

    def __init__(self, path) -> None:
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.hf.eval()
        self.hf.generation_config.eos_token_id = None  # never stop early, like ignore_eos
        self._memo: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}

    @torch.no_grad()
    def __call__(self, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
        key = tuple(prompt)
        if key not in self._memo:
            ids = torch.tensor([prompt])
            logits = self.hf(input_ids=ids).logits[0, -1].float()
            out = self.hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
            )
            self._memo[key] = logits, out[0, len(prompt) :].tolist()
        return self._memo[key]


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def check_runner(ref: Reference, runner: PagedRunner, prompts, chunk: int | None = None) -> float:
    """Paged greedy run vs transformers; returns the largest first-step logit difference."""
    tokens, first = runner.generate(prompts, NEW, chunk=chunk)
    worst = 0.0
    for p, toks, logits in zip(prompts, tokens, first, strict=True):
        want_logits, want = ref(p)
        worst = max(worst, (logits - want_logits).abs().max().item())
        assert len(set(want)) >= 4, "reference output too repetitive to prove anything"
        assert toks == want, f"prompt of {len(p)} tokens: greedy tokens differ"
    assert worst < TOL, f"max logit diff {worst}"
    return worst


def check_distinct(ref: Reference, prompts) -> None:
    """Different prompts continue differently: the weights are not too flat to tell."""
    outs = {tuple(ref(p)[1]) for p in prompts}
    assert len(outs) == len(prompts), "different prompts should continue differently"


def check_prefix_snapshot(ref: Reference, model, config) -> None:
    """Snapshot the states mid-prefill (64 tokens, 4 Mamba2 chunks); the same prompt and one
    sharing those 64 tokens start from it, the second with chunked prefill."""
    runner = PagedRunner(model, config)
    p = prompt(100, 9)
    runner.step([("warm", p[:64], p[:64])])
    assert runner.mgr.snapshot_states("warm")
    runner.mgr.free("warm")
    assert runner.mgr.find_prefix_hit(p).num_tokens == 64
    check_runner(ref, runner, [p])
    other = p[:64] + prompt(37, 10)
    assert runner.mgr.find_prefix_hit(other).num_tokens == 64
    check_runner(ref, runner, [other], chunk=9)


def check_prefix_after_finish(ref: Reference, model, config) -> None:
    """A finished request that ends on a block boundary leaves a state snapshot; a follow-up
    turn (prompt + answer + new tokens) starts from it."""
    runner = PagedRunner(model, config)
    bs = runner.config.block_size
    n = 90 - (90 + NEW - 1) % bs  # computed tokens at the end: a whole number of blocks
    p = prompt(n, 6)
    tokens, _ = runner.generate([p], NEW)
    follow = p + tokens[0][: NEW - 1] + prompt(21, 7)
    assert runner.mgr.find_prefix_hit(follow).num_tokens == n + NEW - 1
    check_runner(ref, runner, [follow])


def check_engine(ref: Reference, model, config, tokenizer) -> None:
    """The real engine: batched, chunked (19 tokens a step), then prefix-cache hits."""
    engine = Engine(
        model, config, EngineConfig(kv_memory_bytes=8 * 2**20, max_num_batched_tokens=19), tokenizer
    )
    shared = prompt(70, 4)
    prompts = [prompt(5, 5), [*shared, 1, 2], prompt(33, 6), prompt(130, 7)]
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [ref(p)[1] for p in prompts]
    again = [[*shared, 1, 2], [*shared, 9, 9, 9]]
    outs = engine.generate(again, GREEDY)
    # both start from the state snapshot the first run left at its prompt's last block boundary
    assert all(o.num_cached_tokens > 0 for o in outs), [o.num_cached_tokens for o in outs]
    assert [o.token_ids for o in outs] == [ref(p)[1] for p in again]
    engine.kv.check_integrity()
    assert engine.kv.num_requests == 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 1


def check_nan_pages(ref, model, config, monkeypatch) -> None:
    """Staggered requests (fresh prompts, chunks and decodes in one step) over a pool full
    of NaN bytes: finite logits; the batched decode rows equal the looped path and
    transformers."""
    from hybrid_pd.engine import paged_attention
    from tests.engine.harness import staggered

    prompts = [prompt(n, 70 + i) for i, n in enumerate((1, 9, 30, 5, 17))]
    runner = PagedRunner(model, config)
    runner.pool.buffer.fill_(0xFF)  # 0xFF bytes are NaN as any float
    tokens, logits, mixed = staggered(runner, prompts, NEW)
    assert mixed >= 5
    assert torch.isfinite(logits).all()
    monkeypatch.setattr(paged_attention, "MIN_DECODE_ROWS", 10**9)
    loop_tokens, loop_logits, _ = staggered(PagedRunner(model, config), prompts, NEW)
    assert (logits - loop_logits).abs().max().item() < TOL
    assert tokens == loop_tokens == [ref(p)[1] for p in prompts]


def check_prefix_hit_with_null_blocks(ref, model, config, local: str, full: str) -> None:
    """A prefix hit past the reach of layer `local`'s window or chunk: its group's early
    blocks are null in the hit, layer `full`'s are not; the hit request stays exact."""
    runner = PagedRunner(model, config)
    shared = prompt(120, 30)
    first, second = [*shared, *prompt(9, 31)], [*shared, *prompt(14, 32)]
    check_runner(ref, runner, [first])
    hit = runner.mgr.find_prefix_hit(second)
    assert hit.num_tokens >= 100
    g_local = runner.config.group_of(local).group_id
    g_full = runner.config.group_of(full).group_id
    assert g_local != g_full
    assert any(b.is_null for b in hit.blocks[g_local]), "unreachable blocks should be null"
    assert not any(b.is_null for b in hit.blocks[g_full])
    check_runner(ref, runner, [second], chunk=9)
