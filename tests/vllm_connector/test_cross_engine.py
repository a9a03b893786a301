"""A hand-over between hybrid-pd's own engine and vLLM is refused, and says why, both
ways. The KV memory layouts differ (one page per block holding a group's layers against one
tensor per layer), so decode computes the request itself, nothing is pulled, the refusal
names the two engines, and the prefill side's lease is dropped at once."""

from __future__ import annotations

import secrets
import time

import pytest

from hybrid_pd.connector.vllm_servers import Server, cpu_halves, start_all
from tests.vllm_connector import checkpoints
from tests.vllm_connector.test_servers import _body, _prompts

pytestmark = pytest.mark.slow


def _settle(read, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_hybrid_pd_prefill_to_vllm_decode_is_refused_with_the_reason(tmp_path):
    import grpc

    from hybrid_pd.api.params import KVTransferParams
    from hybrid_pd.connector.control import call_metadata
    from hybrid_pd.engine.engine import EngineConfig
    from hybrid_pd.proto import worker_pb2 as pb
    from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
    from hybrid_pd.workers.vllm_worker import _vllm_params
    from hybrid_pd.workers.worker import Worker, WorkerConfig

    model = checkpoints.gemma3(tmp_path / "ckpt")
    secret = secrets.token_urlsafe(24)
    (tmp_path / "secret").write_text(secret)
    ours = Worker(
        WorkerConfig(
            role="prefill",
            model=str(model),
            secret=secret,
            engine=EngineConfig(kv_memory_bytes=64 * 2**20),
        )
    )
    decode = Server(
        model,
        tmp_path / "decode.log",
        dtype="float32",
        role="kv_consumer",
        extra={"peers": [ours.address], "secret_file": str(tmp_path / "secret")},
        cpus=cpu_halves()[1],
    )
    try:
        start_all([decode])
        served = decode.client.get("/v1/models").json()["data"][0]["id"]
        prompt = _prompts(3, seed=21)[2]
        body = {**_body(prompt, 8), "model": served}
        want = decode.complete(body)["choices"][0]["token_ids"]
        with grpc.insecure_channel(ours.address) as channel:
            reply = pb_grpc.WorkerStub(channel).Prefill(
                pb.PrefillRequest(
                    request_id="cross",
                    prompt_ids=prompt,
                    sampling=pb.Sampling(max_tokens=8, top_p=1.0, ignore_eos=True),
                ),
                metadata=call_metadata(secret),
                timeout=120,
            )
        kv = KVTransferParams.from_pb(reply.kv_transfer_params)
        assert ours.stats()["leases"] == 1
        got = decode.complete({**body, "kv_transfer_params": _vllm_params(kv)})
        assert got["choices"][0]["token_ids"] == want  # computed by decode alone
        assert decode.metrics().get("hybrid_pd_kv_pulls_total", 0) == 0
        log = (tmp_path / "decode.log").read_text()
        assert "the peer runs hybrid-pd and this worker vLLM" in log, decode.tail()
        assert "hand-overs between the two engines are not supported" in log
        # Dropped by decode at once, not left to expire.
        assert _settle(lambda: ours.stats()["leases"], 0) == 0
    finally:
        decode.stop()
        ours.close()


def test_vllm_prefill_to_hybrid_pd_decode_recomputes_and_names_the_reason(tmp_path):
    import grpc

    from hybrid_pd.api.params import KVTransferParams
    from hybrid_pd.connector.control import call_metadata
    from hybrid_pd.connector.vllm_servers import free_port
    from hybrid_pd.engine.engine import EngineConfig
    from hybrid_pd.proto import worker_pb2 as pb
    from hybrid_pd.proto import worker_pb2_grpc as pb_grpc
    from hybrid_pd.workers.vllm_worker import PARAMS_KEY
    from hybrid_pd.workers.worker import Worker, WorkerConfig

    model = checkpoints.gemma3(tmp_path / "ckpt")
    secret = secrets.token_urlsafe(24)
    (tmp_path / "secret").write_text(secret)
    control = free_port()
    prefill = Server(
        model,
        tmp_path / "prefill.log",
        dtype="float32",
        role="kv_producer",
        extra={"control_port": control, "secret_file": str(tmp_path / "secret")},
        cpus=cpu_halves()[0],
    )
    ours = Worker(
        WorkerConfig(
            role="decode",
            model=str(model),
            secret=secret,
            engine=EngineConfig(kv_memory_bytes=64 * 2**20),
            peers=(f"127.0.0.1:{control}",),
        )
    )
    try:
        start_all([prefill])
        served = prefill.client.get("/v1/models").json()["data"][0]["id"]
        prompt = _prompts(3, seed=22)[2]
        body = {**_body(prompt, 1, {"do_remote_decode": True}), "model": served}
        out = prefill.complete(body)
        first = out["choices"][0]["token_ids"]
        kv = KVTransferParams.from_dict(out["kv_transfer_params"][PARAMS_KEY])
        assert prefill.metrics()["vllm:kv_cache_usage_perc"] > 0  # kept for decode
        sampling = pb.Sampling(max_tokens=8, top_p=1.0, ignore_eos=True)
        meta = call_metadata(secret)
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
        assert usage == 0.0 and prefill.metrics()["hybrid_pd_kv_aborted_total"] == 1
    finally:
        ours.close()
        prefill.stop()
