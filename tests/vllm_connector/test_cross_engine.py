"""A hand-over between hybrid-pd's own engine and vLLM is refused, and says why, both
ways. The KV memory layouts differ (one page per block holding a group's layers against one
tensor per layer), so decode computes the request itself, nothing is pulled, the refusal
names the two engines, and the prefill side's lease is dropped at once. One vLLM server
(kv_both) plays decode in the first test and prefill in the second."""

from __future__ import annotations

import secrets
import time

import pytest

from hybrid_pd.bench.vllm_servers import Server, cpu_halves, start_all
from hybrid_pd.workers.vllm_server import free_port
from tests.vllm_connector import checkpoints
from tests.vllm_connector.test_servers import _body, _prompts

pytestmark = pytest.mark.slow


def _settle(read, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


class Cross:
    def __init__(self, root, model, secret, ours_prefill, server, control):
        self.root, self.model, self.secret = root, model, secret
        self.ours_prefill = ours_prefill  # our engine's prefill worker, a peer of the server
        self.server = server  # vLLM, kv_both: decode for ours_prefill, prefill for our decode
        self.control = control  # the server's control port (its prefill side)
        self.served = server.client.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    from hybrid_pd.engine.engine import EngineConfig
    from hybrid_pd.roles import build_worker
    from hybrid_pd.workers.config import WorkerConfig

    root = tmp_path_factory.mktemp("cross")
    model = checkpoints.gemma3(root / "ckpt")
    secret = secrets.token_urlsafe(24)
    (root / "secret").write_text(secret)
    ours = build_worker(
        WorkerConfig(
            role="prefill",
            model=str(model),
            secret=secret,
            engine=EngineConfig(kv_memory_bytes=64 * 2**20),
        )
    )
    control = free_port()
    server = Server(
        model,
        root / "vllm.log",
        dtype="float32",
        role="kv_both",
        extra={
            "control_port": control,
            "peers": [ours.address],
            "secret_file": str(root / "secret"),
        },
        cpus=cpu_halves()[1],
        single_process=True,
    )
    try:
        start_all([server])
        yield Cross(root, model, secret, ours, server, control)
    finally:
        server.stop()
        ours.close()


def test_hybrid_pd_prefill_to_vllm_decode_is_refused_with_the_reason(cross):
    import grpc

    from hybrid_pd.api.params import KVTransferParams
    from hybrid_pd.connector.control import call_metadata
    from hybrid_pd.proto import worker_pb2 as pb
    from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
    from hybrid_pd.workers.vllm_worker import _vllm_params

    ours, decode = cross.ours_prefill, cross.server
    prompt = _prompts(3, seed=21)[2]
    body = {**_body(prompt, 8), "model": cross.served}
    want = decode.complete(body)["choices"][0]["token_ids"]
    pulls = decode.metrics().get("hybrid_pd_kv_pulls_total", 0)
    with grpc.insecure_channel(ours.address) as channel:
        reply = pb_grpc.WorkerStub(channel).Prefill(
            pb.PrefillRequest(
                request_id="cross",
                prompt_ids=prompt,
                sampling=pb.Sampling(max_tokens=8, top_p=1.0, ignore_eos=True),
            ),
            metadata=call_metadata(cross.secret),
            timeout=120,
        )
    kv = KVTransferParams.from_pb(reply.kv_transfer_params)
    assert ours.stats()["leases"] == 1
    got = decode.complete({**body, "kv_transfer_params": _vllm_params(kv)})
    assert got["choices"][0]["token_ids"] == want  # computed by decode alone
    assert decode.metrics().get("hybrid_pd_kv_pulls_total", 0) == pulls
    log = (cross.root / "vllm.log").read_text()
    assert "the peer runs hybrid-pd and this worker vLLM" in log, decode.tail()
    assert "hand-overs between the two engines are not supported" in log
    # Dropped by decode at once, not left to expire.
    assert _settle(lambda: ours.stats()["leases"], 0) == 0


def test_vllm_prefill_to_hybrid_pd_decode_recomputes_and_names_the_reason(cross):
    import grpc

    from hybrid_pd.api.params import KVTransferParams
    from hybrid_pd.connector.control import call_metadata
    from hybrid_pd.engine.engine import EngineConfig
    from hybrid_pd.proto import worker_pb2 as pb
    from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
    from hybrid_pd.roles import build_worker
    from hybrid_pd.workers.config import WorkerConfig
    from hybrid_pd.workers.vllm_worker import PARAMS_KEY

    prefill = cross.server
    ours = build_worker(
        WorkerConfig(
            role="decode",
            model=str(cross.model),
            secret=cross.secret,
            engine=EngineConfig(kv_memory_bytes=64 * 2**20),
            peers=(f"127.0.0.1:{cross.control}",),
        )
    )
    try:
        aborted = prefill.metrics().get("hybrid_pd_kv_aborted_total", 0)
        prompt = _prompts(3, seed=22)[2]
        body = {**_body(prompt, 1, {"do_remote_decode": True}), "model": cross.served}
        out = prefill.complete(body)
        first = out["choices"][0]["token_ids"]
        kv = KVTransferParams.from_dict(out["kv_transfer_params"][PARAMS_KEY])
        assert prefill.metrics()["vllm:kv_cache_usage_perc"] > 0  # kept for decode
        sampling = pb.Sampling(max_tokens=8, top_p=1.0, ignore_eos=True)
        meta = call_metadata(cross.secret)
        with grpc.insecure_channel(ours.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            handed = stub.Generate(
                pb.GenerateRequest(
                    prompt_ids=prompt, sampling=sampling, kv_transfer_params=kv.to_pb()
                ),
                metadata=meta,
                timeout=120,
            )
            got = [t for chunk in handed for t in chunk.token_ids]
            # The same request recomputed here from prompt + the first token (a migration).
            alone = stub.Generate(
                pb.GenerateRequest(prompt_ids=prompt, sampling=sampling, output_ids=first),
                metadata=meta,
                timeout=120,
            )
            want = [t for chunk in alone for t in chunk.token_ids]
        assert got == want and got[:1] == first
        stats = ours.stats()["decode_connector"]
        assert stats["pulls"] == 0
        assert "the peer runs vLLM and this worker hybrid-pd" in stats["last_error"]
        # The vLLM prefill server's lease was dropped at once (Abort needs no handshake).
        usage = _settle(lambda: prefill.metrics()["vllm:kv_cache_usage_perc"], 0.0)
        assert usage == 0.0
        assert prefill.metrics()["hybrid_pd_kv_aborted_total"] == aborted + 1
    finally:
        ours.close()
