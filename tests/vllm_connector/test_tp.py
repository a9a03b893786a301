"""The connector inside vLLM servers with tensor parallelism: a prefill and a decode
server of two ranks each (vLLM's CPU build, gloo, one core per rank: the two servers
share the machine's two cores), each rank moving its own shard with the other server's
rank of the same number. Output equals one vLLM instance's, every rank's pull succeeds;
servers of different TP sizes are refused by name (the request is recomputed, exactly).
"""

from __future__ import annotations

import random
import secrets

import pytest

from hybrid_pd.bench.vllm_servers import Server, start_all
from hybrid_pd.workers.vllm_server import free_port
from tests.vllm_connector import checkpoints

# Two vLLM CPU servers of two ranks each spin four OpenMP threads on two cores: a request
# takes minutes while anything else runs (the first tries timed out beside other work).
# Collected only with HYBRID_PD_VLLM_TP=1 (conftest.py): run it on a quiet machine.
pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _pd(root, prefill_tp: int, decode_tp: int):
    model = checkpoints.granite_hybrid(root / "ckpt")
    secret = root / "secret"
    secret.write_text(secrets.token_urlsafe(24))
    control = free_port()
    # two spinning servers on two cores are slow: leases long enough to outlast that
    common = {"secret_file": str(secret), "lease_s": 900.0}
    cpus = {1: "0", 2: "0|1"}
    prefill = Server(
        model, root / "prefill.log", dtype="float32", role="kv_producer",
        extra={**common, "control_port": control}, cpus=cpus[prefill_tp],
        tensor_parallel_size=prefill_tp,
    )  # fmt: skip
    decode = Server(
        model, root / "decode.log", dtype="float32", role="kv_consumer",
        extra={**common, "peers": [f"127.0.0.1:{control}"]}, cpus=cpus[decode_tp],
        tensor_parallel_size=decode_tp,
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


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1)])
def test_tp_servers_hand_over_rank_to_rank(tmp_path, prefill_tp, decode_tp):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(n)] for n in (5, 60)]
    prefill, decode = _pd(tmp_path, prefill_tp, decode_tp)
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
        if prefill_tp == decode_tp:  # every rank of decode pulled its shard, none failed
            assert (pulls, failed) == (decode_tp * len(prompts), 0)
        else:  # refused by name before any byte moved; the prompt was recomputed
            assert pulls == 0 and failed == len(prompts)
            assert "tensor-parallel size" in decode.log.read_text()
    finally:
        for server in (prefill, decode):
            server.stop()
