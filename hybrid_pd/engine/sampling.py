"""The sampler: one token per row of logits, by each request's SamplingParams."""

from __future__ import annotations

import torch

from hybrid_pd.api.sampling import SamplingParams

__all__ = ["SamplingParams", "make_generator", "sample"]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32)."""
    if all(p.greedy for p in params):  # the common case: one argmax, one host sync
        return logits.argmax(dim=-1).tolist()
    out = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        scores = row.float() / p.temperature
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < p.top_p  # always keeps the top token
            mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, keep)
            probs = probs.masked_fill(~mask, 0.0)
            probs = probs / probs.sum()
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
