"""A scripted Worker gRPC server on 127.0.0.1: answers Stats, and fails Prefill/Generate the
way a test asks (unavailable, error chunk mid-stream, silence)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from hybrid_pd.proto import worker_pb2 as pb
from hybrid_pd.proto import worker_pb2_grpc as pb_grpc


class FakeWorker(pb_grpc.WorkerServicer):
    """`prefill`: "unavailable" | "internal". `generate`: "ok" | "error_chunk" | "silent" |
    "unavailable"; `tokens` are sent first (one chunk each), then "ok" ends the request."""

    def __init__(self, prefill="unavailable", generate="error_chunk", tokens=(72, 105)):
        # Stats report a fully free pool, so the proxy prefers a fake over a real worker.
        self.prefill_mode = prefill
        self.generate_mode = generate
        self.tokens = list(tokens)
        self.calls: list[tuple[str, str]] = []
        self.cancelled = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0).wait(5)

    def Prefill(self, request, context):
        self.calls.append(("prefill", request.request_id))
        code = {
            "unavailable": grpc.StatusCode.UNAVAILABLE,
            "internal": grpc.StatusCode.INTERNAL,
        }[self.prefill_mode]
        context.abort(code, f"fake prefill {self.prefill_mode}")

    def Generate(self, request, context):
        self.calls.append(("generate", request.request_id))
        if self.generate_mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode unavailable")
        context.add_callback(self.cancelled.set)
        for t in self.tokens:
            yield pb.GenerateChunk(token_ids=[t])
        if self.generate_mode == "ok":
            yield pb.GenerateChunk(finished=True, finish_reason="length")
            return
        if self.generate_mode == "error_chunk":
            yield pb.GenerateChunk(finished=True, finish_reason="error", error="fake engine crash")
            return
        deadline = time.monotonic() + 20  # "silent": say nothing until the client gives up
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)

    def Abort(self, request, context):
        self.calls.append(("abort", request.request_id))
        return pb.AbortReply(ok=False)

    def Describe(self, request, context):
        # Token-id limits only; the proxy's tokenizer comes from its own config (model_path).
        return pb.ModelCard(model="tiny", architecture="Fake", max_model_len=4096)

    def Stats(self, request, context):
        return pb.StatsReply(
            engine_id="fake",
            role="both",
            address=self.address,
            num_blocks=100,
            free_blocks=100,
            running=0,
            waiting=0,
            integrity="ok",
        )  # no role sections: the proxy sends the fake no AddPeers
