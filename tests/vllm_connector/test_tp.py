"""The connector inside vLLM servers with tensor parallelism (vLLM's CPU build, gloo, one
core per rank: the two servers share the machine's two cores). Equal sizes: each rank
moves its own shard with the other server's rank of the same number. Different sizes
(prefill TP 1 -> decode TP 2, TP 2 -> TP 1): each decode rank reads its pieces one-sided
from the prefill ranks holding them. Output equals one vLLM instance's, every pull
succeeds, and none falls back to recomputing.
"""

from __future__ import annotations

import random
import secrets
import time

import pytest

from hybrid_pd.bench.vllm_servers import Server, start_all
from hybrid_pd.workers.vllm_server import free_port
from tests.vllm_connector import checkpoints

# Two vLLM CPU servers of two ranks each spin four OpenMP threads on two cores: a request
# takes minutes while anything else runs (the first tries timed out beside other work).
# Collected only with HYBRID_PD_VLLM_TP=1 (conftest.py): run it on a quiet machine.
pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _pd(root, prefill_tp: int, decode_tp: int, family: str = "granite", blocks=(64, 64)):
    build = {"granite": checkpoints.granite_hybrid, "gemma3": checkpoints.gemma3}[family]
    model = build(root / "ckpt")
    secret = root / "secret"
    secret.write_text(secrets.token_urlsafe(24))
    control = free_port()
    # two spinning servers on two cores are slow: leases long enough to outlast that
    # (and control calls: the prefill's gRPC thread shares a core with spinning ranks)
    common = {"secret_file": str(secret), "lease_s": 900.0, "timeout_s": 120.0}
    cpus = {1: "0", 2: "0|1"}
    # Block ids must mean the same tokens on both servers: vLLM sizes a hybrid model's
    # blocks by its per-rank pages, which may differ between TP sizes (not for these tiny
    # checkpoints: both fit its 128-token CPU default), so the tests name one size.
    # Different TP sizes move pieces one-sided only.
    env = {"HYBRID_PD_UCX_ONESIDED": "1"}
    prefill = Server(
        model, root / "prefill.log", dtype="float32", role="kv_producer",
        extra={**common, "control_port": control}, cpus=cpus[prefill_tp],
        tensor_parallel_size=prefill_tp, env=env, extra_args=("--block-size", str(blocks[0])),
    )  # fmt: skip
    decode = Server(
        model, root / "decode.log", dtype="float32", role="kv_consumer",
        extra={**common, "peers": [f"127.0.0.1:{control}"]}, cpus=cpus[decode_tp],
        tensor_parallel_size=decode_tp, env=env, extra_args=("--block-size", str(blocks[1])),
    )  # fmt: skip
    return prefill, decode


def _run(prefill: Server, decode: Server, prompts) -> tuple[list, list]:
    name = prefill.client.get("/v1/models").json()["data"][0]["id"]
    got, want = [], []
    for prompt in prompts:
        body = {
            "model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }  # fmt: skip
        want.append(decode.complete(body)["choices"][0]["token_ids"])
        out = prefill.complete(
            {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        rest = decode.complete({**body, "kv_transfer_params": out["kv_transfer_params"]})
        got.append(rest["choices"][0]["token_ids"])  # decode's reply: every token
    return got, want


@pytest.mark.parametrize(
    ("family", "prefill_tp", "decode_tp"),
    # Granite-4.0-H-like (Mamba2, n_groups = 1: B and C on every rank; one KV head);
    # Gemma 3-like (sliding window + full attention, one KV head: replicated)
    [("granite", 2, 2), ("granite", 1, 2), ("granite", 2, 1), ("gemma3", 1, 2), ("gemma3", 2, 1)],
)
def test_tp_servers_hand_over(tmp_path, family, prefill_tp, decode_tp):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(n)] for n in (5, 60)]
    prefill, decode = _pd(tmp_path, prefill_tp, decode_tp, family)
    try:
        start_all((prefill, decode), timeout=600)
        before = decode.metrics()
        got, want = _run(prefill, decode, prompts)
        assert len({tuple(w) for w in want}) == len(want), "random weights too flat to tell"
        assert got == want
        m = decode.metrics()
        pulls = m["hybrid_pd_kv_pulls_total"] - before.get("hybrid_pd_kv_pulls_total", 0)
        failed = m.get("hybrid_pd_kv_pull_failures_total", 0) - before.get(
            "hybrid_pd_kv_pull_failures_total", 0
        )
        # equal sizes: each decode rank pulled from its prefill rank; TP 1 -> 2: each
        # decode rank from rank 0; TP 2 -> 1: decode's rank from both prefill ranks, or
        # (Gemma's one KV head, on every rank) from rank 0, releasing rank 1 unread
        per_prompt = 1 if (family, prefill_tp, decode_tp) == ("gemma3", 2, 1) else 2
        assert (pulls, failed) == (per_prompt * len(prompts), 0)
        # every piece read one-sided and confirmed, and every prefill rank's lease
        # released (its blocks freed); prefill's stats come with its steps
        want = {"read_pulls": per_prompt, "released": prefill_tp}
        want = {f"hybrid_pd_kv_{k}_total": n * len(prompts) for k, n in want.items()}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sent = prefill.metrics()
            if all(sent.get(k, 0) >= n for k, n in want.items()):
                break
            time.sleep(1)
        assert {k: sent.get(k, 0) for k in want} == want
    finally:
        for server in (prefill, decode):
            server.stop()


def test_tp_servers_that_cannot_map_recompute_and_say_why(tmp_path):
    """TP 1 -> 2 with blocks of 64 tokens on prefill and 128 on decode (vLLM may pick
    different sizes for different TP sizes of a larger model): the block ids would mean
    other tokens, so decode's scheduler refuses the params by name before any pull and
    computes the prompt itself, exactly."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(n)] for n in (5, 60)]
    prefill, decode = _pd(tmp_path, 1, 2, blocks=(64, 128))
    try:
        start_all((prefill, decode), timeout=600)
        got, want = _run(prefill, decode, prompts)
        assert got == want
        m = decode.metrics()
        assert m.get("hybrid_pd_kv_pulls_total", 0) == 0
        assert "give both servers the same --block-size" in decode.log.read_text()
    finally:
        for server in (prefill, decode):
            server.stop()
