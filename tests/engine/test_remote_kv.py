"""A decode engine whose KV transfer broke halfway must recompute exactly.

The blocks reserved for a transfer hold whatever the broken pull wrote. Freeing them must not
put any of it into the prefix cache: a state page freed on a block boundary used to become a
snapshot, and a recompute of a prompt whose attention blocks were cached hit it.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.sampling import SamplingParams
from tests.checkpoints import BUILDERS

N_NEW = 12


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def loaded(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    return load_model(path)


def make_engine(loaded) -> Engine:
    model, config, tok = loaded
    return Engine(model, config, EngineConfig(kv_memory_bytes=4 * 2**20), tok)


def run_to_end(engine: Engine, rid: str) -> list[int]:
    final = None
    for _ in range(200):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
        if final is not None:
            return final.token_ids
    raise AssertionError("the request did not finish")


def test_recompute_after_half_written_transfer(loaded):
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    engine = make_engine(loaded)
    bs = engine.kv.block_size
    g = torch.Generator().manual_seed(5)
    # A whole number of blocks (the state snapshot boundary) and longer than any window.
    prompt = torch.randint(3, 256, (6 * bs,), generator=g).tolist()
    want = engine.generate([prompt], params)[0].token_ids
    assert len(set(want)) > 2, "random weights too flat: greedy output does not vary"
    # The same engine goes on: the prompt's attention blocks are in its prefix cache now,
    # so a bad state snapshot at the prompt's end would be hit by the recompute.
    reserved = engine.reserve_remote("r", prompt, want[0], params)
    assert reserved is not None
    req, block_ids = reserved
    written = 0
    for group in block_ids:  # the broken pull wrote garbage into half of the blocks
        for b in group[len(group) // 2 :]:
            if b:
                engine.pool.region(b, 1).copy_(
                    torch.randint(0, 256, (1, engine.pool.region(b, 1).shape[1]), dtype=torch.uint8)
                )
                written += 1
    assert written > 0
    engine.cancel_remote(req)
    engine.kv.check_integrity()
    rid = engine.add_request(prompt, params, "r", output_ids=[want[0]])
    assert run_to_end(engine, rid) == want
    engine.kv.check_integrity()
    assert engine.kv.num_requests == 0
