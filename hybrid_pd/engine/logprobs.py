"""Log-probabilities of chosen tokens and their top alternatives, from logits rows."""

from __future__ import annotations

import torch

from hybrid_pd.api.sampling import TokenLogprob

#: Prompt positions scored per logits computation (bounds the [rows, vocab] temporary).
PROMPT_SLICE = 256


def logprobs_of(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """Row i of `logits` [N, vocab] scored at `tokens[i]`, with its `top[i]` best tokens.

    Raw model distribution: temperature, top-k and top-p do not change the numbers."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(tokens, device=lsm.device).unsqueeze(1)
    chosen = lsm.gather(1, index).squeeze(1).tolist()
    k = max(top, default=0)
    best_v, best_i = lsm.topk(k, dim=-1) if k else (None, None)
    out = []
    for i, (value, n) in enumerate(zip(chosen, top, strict=True)):
        pairs = ()
        if n:
            pairs = tuple(zip(best_i[i, :n].tolist(), best_v[i, :n].tolist(), strict=True))
        out.append(TokenLogprob(value, pairs))
    return out


def score_prompt(head, seq, req) -> None:
    """Fill `req.prompt_logprobs` for the prompt positions this step computed: the logits
    at position p score prompt token p + 1. Indexed by position, so recomputing a prompt
    (preemption, a failed load) writes the same values again, never twice. `head(index)`:
    the logits of the step's hidden states at `index` (a slice of rows)."""
    prompt = req.prompt_ids
    first = seq.num_computed
    last = min(seq.num_computed + seq.num_new, len(prompt) - 1)  # p + 1 must be a prompt token
    k = req.params.prompt_logprobs
    for lo in range(first, last, PROMPT_SLICE):
        hi = min(lo + PROMPT_SLICE, last)
        logits = head(slice(seq.start + lo - first, seq.start + hi - first))
        scored = logprobs_of(logits, prompt[lo + 1 : hi + 1], [k] * (hi - lo))
        req.prompt_logprobs[lo + 1 : hi + 1] = scored
