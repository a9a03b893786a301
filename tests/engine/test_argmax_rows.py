"""The greedy sampler's argmax_rows gives torch.argmax's indices: first of equal maxima,
first NaN, all -inf rows, a vocab past the last whole block, bfloat16."""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.engine.sampling import SamplingParams, argmax_rows, sample


@pytest.mark.parametrize("vocab", [32000, 32003, 300, 127, 128, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_indices_as_argmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=g).to(dtype)
    last = vocab - 1
    x[0, :] = 1.0  # all equal: the first
    x[1, :] = float("-inf")
    x[2, [min(5, last), last]] = 50.0  # a tie, one in the tail where there is one
    x[3, last] = 50.0  # the maximum in the tail alone
    x[4, [min(7, last), last]] = float("nan")  # NaN in a block and in the tail
    x[5, last] = float("nan")  # NaN only in the tail
    x[6, min(3, last)] = float("nan")
    x[7, last] = float("inf")
    x[8] = torch.randint(-2, 3, (vocab,), generator=g).to(dtype)  # many ties
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1)), (got[:9], x.argmax(dim=-1)[:9])


def test_strided_rows_and_the_sampler():
    x = torch.randn(6, 2 * 32000)[:, ::2]  # not contiguous along the vocab
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    logits = torch.randn(5, 1000)
    greedy = [SamplingParams(temperature=0.0)] * 5
    assert sample(logits, greedy, [None] * 5) == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_and_top_p_sample_the_top_token():
    # logits / 1e-40 overflowed float32 to inf, and a top_p that rounds to 0 in float32
    # masked every token: both failed the step (every request on the worker with it)
    from hybrid_pd.api.sampling import MIN_TOP_P

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 4
    top = logits.argmax(dim=-1).tolist()
    cold = SamplingParams(temperature=1e-40, seed=1)
    assert cold.temperature == 0.0 and cold.greedy
    assert sample(logits, [cold] * 4, [None] * 4) == top
    narrow = SamplingParams(temperature=1.0, top_p=1e-46, seed=1)
    assert narrow.top_p == MIN_TOP_P
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    assert sample(logits, [narrow] * 4, gens) == top
    # and the sampler keeps the top token for any top_p float32 reads as 0
    raw = SamplingParams(temperature=1.0, top_p=0.5)
    object.__setattr__(raw, "top_p", 1e-46)
    assert sample(logits, [raw] * 4, gens) == top
    # temperatures from MIN_TEMPERATURE up still sample
    assert not SamplingParams(temperature=1e-5).greedy
