"""Constrained decoding: compiled grammars (cached), per-request matchers, token masks.

    Constraint ──compile (once per constraint; a worker does it in a thread, before the
    request reaches the engine loop)──► Grammar (llguidance matcher in its start state)
    Grammar.matcher() ──► a request's own matcher, advanced with each token it gets
    each step: masks of the constrained rows ──► their disallowed logits set to -inf

The cache is keyed by the constraint (its kind and text); the tokenizer is the engine's,
fixed for the cache's life. Compiling twice gives equal matchers, so a prefill worker, a
decode worker and a migration target all constrain a request alike.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from hybrid_pd.api.constraint import Constraint, parser_limits

#: Compiled grammars kept per engine (least recently used dropped first).
CACHE_SIZE = 128


class Grammar:
    """One compiled constraint: `matcher()` gives a fresh matcher in the start state."""

    def __init__(self, constraint: Constraint, prototype) -> None:
        self.constraint = constraint
        self._prototype = prototype

    def matcher(self):
        """A new llguidance `LLMatcher` (copies share the compiled grammar)."""
        return self._prototype.deep_copy()


class GrammarCache:
    """Compiles constraints against one tokenizer; thread-safe (RPC handlers compile from
    worker threads while the engine thread takes matchers)."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str] | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        capacity: int = CACHE_SIZE,
    ) -> None:
        """`tokenizer_json`: gives the tokenizer's `tokenizer.json` text, asked once, at the
        first compile (None: no tokenizer, every constraint is refused); `vocab_size`: the
        model's logits width (ids past the tokenizer's are never allowed)."""
        self._json = tokenizer_json
        self._vocab = vocab_size
        self._eos = list(eos_token_ids)
        self._capacity = capacity
        self._tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Grammar] = OrderedDict()
        self.compiled = 0  # compilations done (cache misses)

    def _llm_tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            if self._json is None:
                raise ValueError("structured output needs a model with a tokenizer")
            try:  # about a second for a 150k-token vocabulary
                self._tokenizer = llguidance.LLTokenizer(
                    self._json(), n_vocab=self._vocab, eos_token=self._eos or None
                )
            except (ValueError, RuntimeError) as e:
                raise ValueError(
                    f"structured output is unavailable for this tokenizer: {e}"
                ) from None
        return self._tokenizer

    def compile(self, constraint: Constraint) -> Grammar:
        """The constraint's grammar, compiled now or taken from the cache. ValueError (the
        message names the problem) when it cannot be compiled. Compiling can take from
        milliseconds to about a second for a large schema: call it off the engine loop."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
            tokenizer = self._llm_tokenizer()
        import llguidance

        try:
            text = constraint.grammar()
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {constraint.kind}: {e}") from None
        # the library drops the GIL while it builds the grammar
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.kind}: {_first_line(matcher.get_error())}")
        grammar = Grammar(constraint, matcher)
        with self._lock:
            self.compiled += 1
            self._cache[constraint] = grammar
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return grammar


def consume(matcher, tokens: Sequence[int]) -> bool:
    """Advance `matcher` by `tokens` (replayed or just sampled); False when one of them
    breaks the grammar."""
    return not tokens or matcher.consume_tokens([int(t) for t in tokens])


def sync_grammar(req) -> bool:
    """Feed a request's matcher the output tokens it has not seen (replayed ones: a prefill
    worker's first token, a migrated stream's tokens). False if they break it."""
    ok = consume(req.matcher, req.output_ids[req.matched :])
    req.matched = len(req.output_ids)
    return ok


def advance_grammar(req) -> None:
    """After a sampled token: the request ends ("stop") where its grammar does, and with an
    error where the token broke it."""
    if not sync_grammar(req):
        req.finish_reason = req.finish_reason or "error"
        req.error = req.error or "the sampled token broke the constraint"
    elif req.finish_reason is None and is_done(req.matcher):
        req.finish_reason = "stop"


def is_done(matcher) -> bool:
    """The grammar accepts no further token (other than end-of-sequence)."""
    return matcher.is_stopped()


_EXECUTOR = None
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 1) // 2)))
    return _EXECUTOR


def mask_logits(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence) -> torch.Tensor:
    """A copy of `logits` [N, vocab] with each of `rows` limited to the tokens its matcher
    allows next (the others -inf); other rows unchanged. A matcher that allows nothing (an
    error state) leaves only its end-of-sequence tokens, which ends the request."""
    out = logits.clone()
    if not rows:
        return out
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr(
        [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(rows)
    )
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor(list(rows), device=logits.device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def _first_line(message: str, limit: int = 500) -> str:
    text = message.strip()
    return (text.splitlines()[0] if text else "cannot compile")[:limit]
