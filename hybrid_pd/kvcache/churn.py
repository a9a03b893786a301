"""A mixed workload that churns a pool, so benchmarks and tests see real fragmentation.

Requests of random lengths (some sharing a system prefix, so prefix hits and cached blocks
happen when caching is on) are admitted the way one worker role does it, kept alive for a
while and freed in random order. At the end the requests still alive are freed at random
until `keep_free` blocks are free; the others stay, holding their blocks, as they would in
a busy server:

    prefill: prefix lookup, chunked prefill (allocate, commit, release out-of-window blocks)
    decode:  blocks for a transferred prompt (`allocate_external`), commit, some output tokens
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hybrid_pd.kvcache.ids import RequestId
from hybrid_pd.kvcache.manager import KVCacheManager

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ChurnReport:
    requests: int
    live_after: int  # requests still holding blocks when the churn ends
    free_blocks_after: int
    cached_blocks_after: int


def churn(
    kv: KVCacheManager,
    num_requests: int,
    max_len: int,
    *,
    role: str = "prefill",
    chunk: int = 2048,
    keep_free: int = 0,
    seed: int = 0,
) -> ChurnReport:
    """Run `num_requests` mixed requests through `kv` as `role` does (see the module
    docstring). Request ids are `churn-<i>`; the ones left alive keep their blocks."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}: {role!r}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 50_000) for _ in range(n)] for n in (256, 1024, 2048)]
    live: list[RequestId] = []

    def free_one() -> None:
        kv.free(live.pop(rng.randrange(len(live))))

    for i in range(num_requests):
        rid = RequestId(f"churn-{i}")
        n = max(16, min(max_len, int(2 ** rng.uniform(4, max_len.bit_length() - 1))))
        prefix = rng.choice(prefixes) if rng.random() < 0.5 else []
        tokens = (prefix + [rng.randrange(1000, 50_000) for _ in range(n)])[:n]
        while not _admit(kv, rid, tokens, role, chunk, rng):
            if not live:
                raise RuntimeError(f"a {n}-token request does not fit an empty pool")
            free_one()
        live.append(rid)
        while live and rng.random() < 0.5:
            free_one()
    while live and kv.pool.num_free_blocks < keep_free:
        free_one()
    return ChurnReport(num_requests, len(live), kv.pool.num_free_blocks, kv.pool.num_cached_blocks)


def _admit(
    kv: KVCacheManager, rid: RequestId, tokens: list[int], role: str, chunk: int, rng
) -> bool:
    """Run one request's admission; False (and nothing held) when the pool is short."""
    n = len(tokens)
    if role == "decode":
        if kv.allocate_external(rid, tokens, n) is None:
            return False
        kv.commit_computed(rid, n)
        for _ in range(rng.randrange(0, 16)):  # output tokens, 16 at a time
            tokens.extend(rng.randrange(1000, 50_000) for _ in range(16))
            if kv.allocate_slots(rid, tokens, 16) is None:
                break
            kv.commit_computed(rid, len(tokens))
        return True
    hit = kv.find_prefix_hit(tokens)
    done = hit.num_tokens
    first = True
    while done < n:
        step = min(chunk, n - done)
        if kv.allocate_slots(rid, tokens, step, hit if first else None) is None:
            kv.free(rid, keep_cached=False)
            return False
        first = False
        kv.finish_state_copies(rid)
        done += step
        kv.commit_computed(rid, done)
    kv.release_out_of_window(rid)
    return True
