"""Prefill and decode in two processes (real gRPC, real UCX): output equals one engine."""

from __future__ import annotations

import pytest

from hybrid_pd.api.wire import sampling_to_pb
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.kvcache.grouping import HMAOffError, plan_groups
from hybrid_pd.kvcache.hf_configs import cache_spec_from_config
from tests.checkpoints import BUILDERS, MAMBA_CHUNK, SW_WINDOW
from tests.connector.pd_fixtures import (
    Pair,
    no_leaks,
    prompt,
    reference_engine,
    reference_tokens,
    wait_until,
)

pytestmark = pytest.mark.slow

N_NEW = 12
# Shorter and longer than the sliding window (16); several Mamba2 (16) and GDN (64) chunks.
LENGTHS = (5, 3 * SW_WINDOW + 1, 9 * MAMBA_CHUNK + 3)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def arch(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    pair = Pair(path)
    try:
        yield request.param, path, pair, reference_engine(path)
    finally:
        pair.close()


def test_pd_output_equals_single_engine(arch):
    name, path, pair, ref = arch
    sampling = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    kv_config = ref.kv_config
    spec = cache_spec_from_config(str(path), dtype="float32")
    for i, n in enumerate(LENGTHS):
        p = prompt(n, seed=i)
        expected = reference_tokens(ref, p, N_NEW)
        assert len(set(expected)) >= 4, "reference output does not vary"
        first = pair.prefill.prefill(f"{name}-{i}", p, sampling)
        assert first.first_token == expected[0]
        out = pair.decode.generate(f"{name}-{i}", p, sampling, first.kv_transfer_params)
        assert out.error == "" and out.token_ids == expected, name
        # Bytes shipped are the computed minimum: every group's needed pages, nothing more.
        assert out.transfer["bytes"] == kv_config.bytes_per_request(n)
        assert not out.transfer["recomputed"]
        assert 1 <= out.transfer["messages"] <= len(kv_config.groups)
        try:
            off = plan_groups(spec, hma=False, block_size=kv_config.block_size)
            if n > 2 * SW_WINDOW:  # past the window HMA ships strictly less
                assert off.bytes_per_request(n) > out.transfer["bytes"]
        except HMAOffError:
            assert spec.state_layers  # Mamba/GDN models cannot run with HMA off at all
    for client in (pair.prefill, pair.decode):
        wait_until(lambda c=client: no_leaks(c.stats()), 10, "blocks to be freed")
