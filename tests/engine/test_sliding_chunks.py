"""A prefill chunk needs a block for every one of its tokens before a sliding-window layer
can drop the blocks that slid out, so one chunk may need more blocks than the request ever
keeps. A request alone in a pool that holds it but not such a chunk gets smaller chunks (it
used to wait forever for blocks nobody would free)."""

from __future__ import annotations

import pytest
import torch

from hybrid_pd.engine.engine import Engine, EngineConfig
from hybrid_pd.engine.loader import load_model
from hybrid_pd.engine.sampling import SamplingParams
from tests import checkpoints

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
# Gemma 3 (sliding + full layers) and Mistral (sliding on every layer).
BUILDS = {"gemma3": checkpoints.gemma3, "mistral": checkpoints.mistral}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_chunk_larger_than_the_free_pool_is_split(name, tmp_path):
    model, config, tok = load_model(BUILDS[name](tmp_path))
    roomy = Engine(model, config, EngineConfig(), tok)
    kv = roomy.kv_config
    prompt = torch.randint(3, 256, (8 * kv.block_size,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    want = roomy.generate([prompt], GREEDY)[0].token_ids
    # One block more than the request needs; the whole prompt as one chunk needs more.
    need = kv.blocks_per_request(len(prompt) + GREEDY.max_tokens)
    tight = Engine(
        model, config, EngineConfig(kv_memory_bytes=(need + 1) * kv.page_size_bytes), tok
    )
    assert tight.kv.pool.num_blocks - 1 == need
    rid = tight.add_request(prompt, GREEDY)
    final = None
    for _ in range(200):
        final = next((o for o in tight.step() if o.finished), final)
        if not tight.has_unfinished():
            break
    assert final is not None and final.request_id == rid, "the request never finished"
    assert final.token_ids == want
    tight.kv.check_integrity()
    assert tight.kv.pool.num_free_blocks == tight.kv.pool.num_blocks - 1
