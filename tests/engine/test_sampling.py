"""The sampler's generator use, on the device the tests run on: a seeded generator after
k draws from any probabilities is where a fresh one is after k skip-draws, so a request that
resumes after tokens sampled elsewhere draws what one engine would."""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.api.sampling import SamplingParams
from hybrid_pd.engine.sampling import sample, skip_draws

# every device this machine has: the generator's use is a property of the device's kernels
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def state(gen: torch.Generator) -> torch.Tensor:
    return gen.get_state()


def random_logits(g: torch.Generator, width: int) -> torch.Tensor:
    """Logits of every shape of distribution: peaked, flat, masked (-inf) columns."""
    scale = float(torch.rand(1, generator=g)) * 20
    logits = torch.randn(width, generator=g) * scale
    masked = torch.rand(width, generator=g) < float(torch.rand(1, generator=g))
    masked[int(torch.randint(width, (1,), generator=g))] = False
    return logits.masked_fill(masked, float("-inf"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [300, 32_000])
def test_skip_draws_reach_the_state_of_real_draws(width, device):
    """k draws through `sample` (temperature, top-k, top-p, masked logits) leave the
    generator where k skip-draws leave a fresh one; the next draws then agree."""
    g = torch.Generator().manual_seed(width)
    device = torch.device(device)
    settings = [
        SamplingParams(max_tokens=1, temperature=1.0, seed=1),
        SamplingParams(max_tokens=1, temperature=0.3, top_k=5, seed=1),
        SamplingParams(max_tokens=1, temperature=1.7, top_p=0.5, seed=1),
        SamplingParams(max_tokens=1, temperature=0.9, top_k=40, top_p=0.9, seed=1),
    ]
    for seed, params in enumerate(settings):
        drawn = torch.Generator(device=device).manual_seed(seed)
        for k in range(1, 9):
            logits = random_logits(g, width).to(device)
            sample(logits[None], [params], [drawn])
            skipped = torch.Generator(device=device).manual_seed(seed)
            skip_draws(skipped, width, k, device)
            assert torch.equal(state(drawn), state(skipped)), (seed, k)
        nxt = random_logits(g, width).to(device)[None]
        assert sample(nxt, [params], [drawn]) == sample(nxt, [params], [skipped])


def test_skip_nothing():
    gen = torch.Generator().manual_seed(3)
    before = state(gen).clone()
    skip_draws(gen, 100, 0, torch.device("cpu"))
    skip_draws(gen, 100, -2, torch.device("cpu"))
    assert torch.equal(state(gen), before)
