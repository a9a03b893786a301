"""P/D between two real vLLM servers through hybrid-pd's connector, the way vLLM's own
disaggregation examples run: the prompt goes to the prefill server with
`kv_transfer_params: {"do_remote_decode": true}` and max_tokens 1, then the same request
goes to the decode server with the kv_transfer_params the prefill returned. The first
token comes from the prefill response, the rest from decode; together they must equal a
single vLLM instance's tokens."""

from __future__ import annotations

import json
import random
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybrid_pd.bench.vllm_servers import Server, cpu_halves, start_all
from hybrid_pd.workers.vllm_server import free_port
from tests.vllm_connector import checkpoints

pytestmark = pytest.mark.slow

STUBS = Path(__file__).resolve().parent / "stubs"
# family: (checkpoint builder, --dtype, extra environment)
FAMILIES = {
    "gemma3": (checkpoints.gemma3, "float32", {}),
    "granite_hybrid": (checkpoints.granite_hybrid, "float32", {}),
    # vLLM's CPU Qwen3.5 computes in bf16 only; its module imports torchvision (stubbed).
    "qwen3_5": (checkpoints.qwen3_5, "bfloat16", {"PYTHONPATH": str(STUBS)}),
}
MAX_TOKENS = 12
ZEROS_MARK = "hpd-zero-sends"
#: Both servers pull one-sided (opt-in; the other vLLM tests run the default, two-sided).
ONE_SIDED = {"HYBRID_PD_UCX_ONESIDED": "1"}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [5, 40, 129, 300, 700][:n] + [rng.randrange(3, 600) for _ in range(max(0, n - 5))]
    return [[rng.randrange(3, checkpoints.VOCAB - 1) for _ in range(k)] for k in lengths]


def _body(prompt, max_tokens: int, params=None) -> dict:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


class PD:
    def __init__(self, prefill: Server, decode: Server, dtype: str, secret: str, model: Path):
        self.prefill, self.decode = prefill, decode
        self.model_path = model
        self.dtype = dtype
        self.secret = secret  # the connectors' control-plane secret
        self.model = prefill.client.get("/v1/models").json()["data"][0]["id"]

    def body(self, prompt, max_tokens: int, params=None) -> dict:
        return {**_body(prompt, max_tokens, params), "model": self.model}

    def reference(self, prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
        """The decode server alone (no kv_transfer_params): one vLLM instance."""
        return self.decode.complete(self.body(prompt, max_tokens))["choices"][0]["token_ids"]

    def hand_off(self, prompt, zeros: bool = False) -> tuple[list[int], dict]:
        """Prefill's first token and kv_transfer_params; `zeros`: the prefill server sends
        zeros in place of this request's KV (its fault injection, keyed on the request id)."""
        body = self.body(prompt, 1, {"do_remote_decode": True})
        headers = {"X-Request-Id": f"{ZEROS_MARK}-{secrets.token_hex(4)}"} if zeros else None
        out = self.prefill.complete(body, headers=headers)
        return out["choices"][0]["token_ids"], out["kv_transfer_params"]

    def run(
        self, prompt, max_tokens: int = MAX_TOKENS, stream: bool = False, zeros: bool = False
    ) -> list[int]:
        """As vLLM's own P/D routers go: the prefill's reply is thrown away but for its
        kv_transfer_params, and decode's reply is the answer, every token of it."""
        _, params = self.hand_off(prompt, zeros)
        body = self.body(prompt, max_tokens, params)
        if stream:
            return self.decode.stream_tokens(body)
        return self.decode.complete(body)["choices"][0]["token_ids"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pd(request, tmp_path_factory):
    build, dtype, env = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = build(root / "ckpt")
    secret = root / "secret"
    secret.write_text(secrets.token_urlsafe(24))
    control = free_port()
    prefill_cpus, decode_cpus = cpu_halves()
    # Zeros arrive in place of the KV for requests whose id carries ZEROS_MARK (the
    # negative control: the decode server writes them over what it read one-sided; a
    # prefill server that sends, two-sided, sends zeros), the real KV for every other. Both run
    # the model in the engine-core process (vLLM's executor for one GPU); the multi-node
    # test runs vLLM's CPU default, a worker process of its own.
    prefill = Server(
        model,
        root / "prefill.log",
        dtype=dtype,
        role="kv_producer",
        extra={"control_port": control, "secret_file": str(secret)},
        cpus=prefill_cpus,
        env={**env, **ONE_SIDED, "HYBRID_PD_INJECT_FAULT": f"zero_sends:{ZEROS_MARK}"},
        single_process=True,
    )
    decode = Server(
        model,
        root / "decode.log",
        dtype=dtype,
        role="kv_consumer",
        # No `peers`: the decode server pulls from a prefill server it was never told of,
        # trusting it because the params are signed with the shared secret (as behind a
        # router whose prefill pool changes).
        extra={"secret_file": str(secret)},
        cpus=decode_cpus,
        env={**env, **ONE_SIDED, "HYBRID_PD_INJECT_FAULT": f"zero_sends:{ZEROS_MARK}"},
        single_process=True,
    )
    servers = (prefill, decode)
    try:
        start_all(servers)
        yield PD(prefill, decode, dtype, secret.read_text(), model)
    finally:
        for server in servers:
            server.stop()
            assert not server.temp_dir.exists()  # vLLM's sockets went with it


def _settle(server: Server, name: str, want: float, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m.get(name, 0.0) == want or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def test_pd_equals_single_instance(pd):
    prompts = _prompts(5, seed=1)
    before = pd.decode.metrics()
    refs = [pd.reference(p) for p in prompts]
    assert len({tuple(r) for r in refs}) == len(refs), "random weights too flat to tell"
    for prompt, ref in zip(prompts, refs, strict=True):
        assert pd.run(prompt) == ref, f"prompt of {len(prompt)} tokens"
    after = _settle(
        pd.decode,
        "hybrid_pd_kv_pulls_total",
        before.get("hybrid_pd_kv_pulls_total", 0.0) + len(prompts),
    )
    assert after["hybrid_pd_kv_pulls_total"] - before.get("hybrid_pd_kv_pulls_total", 0) == 5
    assert after.get("hybrid_pd_kv_pull_failures_total", 0) == before.get(
        "hybrid_pd_kv_pull_failures_total", 0
    )
    assert after["hybrid_pd_kv_bytes_pulled_total"] > before.get(
        "hybrid_pd_kv_bytes_pulled_total", 0
    )


def test_decode_continues_from_the_pulled_kv(pd):
    """Negative control: when the prefill server sends zeros in place of the KV, the
    pulls succeed and decode's tokens differ from the reference. Decode really computes
    from what it pulls; nothing recomputes the prompt behind the connector's back."""
    prompts = _prompts(5, seed=5)[1:4]  # 40, 129 and 300 tokens
    refs = [pd.reference(p) for p in prompts]
    before = pd.decode.metrics()
    for prompt, ref in zip(prompts, refs, strict=True):
        got = pd.run(prompt, zeros=True)
        assert got[0] == ref[0]  # the first token comes from the (correct) prefill
        assert got != ref, f"prompt of {len(prompt)} tokens decoded alike from zeroed KV"
    after = _settle(
        pd.decode,
        "hybrid_pd_kv_pulls_total",
        before.get("hybrid_pd_kv_pulls_total", 0) + len(prompts),
    )
    assert after["hybrid_pd_kv_pulls_total"] - before.get("hybrid_pd_kv_pulls_total", 0) == 3
    assert after.get("hybrid_pd_kv_pull_failures_total", 0) == before.get(
        "hybrid_pd_kv_pull_failures_total", 0
    )


def test_text_prompt_and_stream(pd):
    prompt = "The hybrid cache manager hands blocks to decode."
    ref = pd.reference(prompt)
    assert pd.run(prompt) == ref
    assert pd.run(prompt, stream=True) == ref


def test_concurrent_hand_offs(pd):
    prompts = _prompts(12, seed=2)
    refs = [pd.reference(p) for p in prompts]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(pd.run, prompts))
    assert got == refs


def test_bytes_sent_equal_bytes_pulled_and_nothing_leaks(pd):
    # Every kept request was released by its pull; the prefill pool is empty again.
    m = _settle(pd.prefill, "vllm:kv_cache_usage_perc", 0.0)
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["hybrid_pd_kv_handed_over_total"] == m["hybrid_pd_kv_released_total"]
    assert m.get("hybrid_pd_kv_expired_total", 0) == 0
    sent = m.get("hybrid_pd_kv_bytes_sent_total", 0)
    assert sent > 0
    assert sent == pd.decode.metrics()["hybrid_pd_kv_bytes_pulled_total"]
    # decode read them one-sided (as asked); the prefill server confirmed every pull
    assert m["hybrid_pd_kv_read_pulls_total"] == m["hybrid_pd_kv_pulled_from_total"] > 0


def test_replayed_params_recompute_exactly(pd):
    """Params whose KV was already pulled and released: the pull fails, the request
    recomputes (kv_load_failure_policy recompute), and the tokens are still exact.

    Recompute prefills prompt + first token in one pass where a single instance prefills
    the prompt and then decodes the first token: the same sums, cut differently. In fp32
    that leaves greedy tokens unchanged; vLLM's CPU Qwen3.5 computes in bf16, where the
    cut shows, so there the check is against one instance given prompt + first token."""
    prompt = _prompts(3, seed=3)[2]
    ref = pd.reference(prompt)
    first, params = pd.hand_off(prompt)
    body = pd.body(prompt, MAX_TOKENS, params)
    assert pd.decode.complete(body)["choices"][0]["token_ids"] == ref
    failures = pd.decode.metrics().get("hybrid_pd_kv_pull_failures_total", 0)
    if pd.dtype != "float32":
        ref = first + pd.reference(prompt + first, MAX_TOKENS - 1)
    # the replayed reply starts with the prefill's token too
    assert pd.decode.complete(body)["choices"][0]["token_ids"] == ref
    m = _settle(pd.decode, "hybrid_pd_kv_pull_failures_total", failures + 1)
    assert m["hybrid_pd_kv_pull_failures_total"] == failures + 1


def test_params_for_another_prompt_compute_locally(pd):
    a, b = _prompts(2, seed=4)
    _, params = pd.hand_off(a)
    pulls = pd.decode.metrics().get("hybrid_pd_kv_pulls_total", 0)
    # b with a's params: refused (prompt digest), computed alone: the single-instance
    # output of b without its first token from a prefill.
    full = pd.reference(b)
    out = pd.decode.complete(pd.body(b, MAX_TOKENS, params))["choices"][0]["token_ids"]
    assert out == full
    assert pd.decode.metrics().get("hybrid_pd_kv_pulls_total", 0) == pulls
    # a's lease was dropped at once, not left to expire.
    m = _settle(pd.prefill, "vllm:kv_cache_usage_perc", 0.0)
    assert m["vllm:kv_cache_usage_perc"] == 0.0


def test_logprobs_on_decode_compute_locally(pd):
    """Decode's reply starts with the prefill's token, whose logprobs the params do not
    carry: a decode request asking for logprobs computes alone (exact, nothing pulled) and
    the prefill's lease is dropped at once."""
    prompt = _prompts(2, seed=6)[1]
    _, params = pd.hand_off(prompt)
    pulls = pd.decode.metrics().get("hybrid_pd_kv_pulls_total", 0)
    out = pd.decode.complete({**pd.body(prompt, MAX_TOKENS, params), "logprobs": 1})
    assert out["choices"][0]["token_ids"] == pd.reference(prompt)
    assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == MAX_TOKENS
    assert pd.decode.metrics().get("hybrid_pd_kv_pulls_total", 0) == pulls
    m = _settle(pd.prefill, "vllm:kv_cache_usage_perc", 0.0)
    assert m["vllm:kv_cache_usage_perc"] == 0.0


def test_structured_output_on_decode_computes_locally(pd):
    """vLLM applies a request's grammar from the first output token on; the prefill's token
    would be prompt on decode, so a constrained decode request computes alone: its output
    equals one instance's under the same constraint and nothing is pulled."""
    prompt = _prompts(2, seed=8)[1]
    constraint = {"structured_outputs": {"regex": "[0-9]{4,12}"}}
    body = {**pd.body(prompt, MAX_TOKENS), **constraint}
    ref = pd.decode.complete(body)["choices"][0]
    assert ref["text"][:1].isdigit(), ref["text"]  # the constraint applies (at the start)
    pre = pd.prefill.complete(
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    pulls = pd.decode.metrics().get("hybrid_pd_kv_pulls_total", 0)
    out = pd.decode.complete({**body, "kv_transfer_params": pre["kv_transfer_params"]})
    assert out["choices"][0]["token_ids"] == ref["token_ids"]
    assert pd.decode.metrics().get("hybrid_pd_kv_pulls_total", 0) == pulls


def test_hybrid_pd_proxy_serves_a_vllm_pool(pd):
    """hybrid-pd's own proxy in front of the two vLLM servers, each behind a VllmWorker
    (our Worker gRPC API relayed to vLLM's HTTP API): every prompt goes prefill -> decode
    through our connector, and the tokens equal one vLLM instance's, whole and streamed."""
    import httpx

    from hybrid_pd.proxy.config import ProxyConfig
    from hybrid_pd.proxy.server import ProxyHandle
    from hybrid_pd.workers.vllm_worker import VllmWorker

    shims = [
        VllmWorker(pd.prefill.url, "prefill", pd.model, secret=pd.secret),
        VllmWorker(pd.decode.url, "decode", pd.model, secret=pd.secret),
    ]
    config = ProxyConfig(
        port=0,
        served_model_names=("m",),
        prefill_addresses=(shims[0].address,),
        decode_addresses=(shims[1].address,),
        min_prefill_tokens=1,
        secret=pd.secret,
    )
    prompts = _prompts(4, seed=11)
    refs = [pd.reference(p) for p in prompts]
    before = pd.decode.metrics().get("hybrid_pd_kv_pulls_total", 0.0)
    try:
        with ProxyHandle(config) as proxy, httpx.Client(base_url=proxy.url, timeout=120) as c:
            card = c.get("/v1/models/m").json()
            assert card["max_model_len"] == 1024
            for prompt, ref in zip(prompts, refs, strict=True):
                body = {**_body(prompt, MAX_TOKENS), "model": "m"}
                got = c.post("/v1/completions", json=body)
                assert got.status_code == 200, got.text
                assert got.json()["choices"][0]["token_ids"] == ref, f"{len(prompt)} tokens"
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                lines = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
            streamed = [t for ln in lines for t in json.loads(ln[6:])["choices"][0]["token_ids"]]
            assert streamed == refs[-1]
            _logprobs_equal_one_instance(pd, c, prompts[1])
            metrics = c.get("/metrics").text
    finally:
        for shim in shims:
            shim.close()
    assert 'hybrid_pd_proxy_routes_total{route="disaggregated"} 8.0' in metrics
    after = _settle(pd.decode, "hybrid_pd_kv_pulls_total", before + 8)
    assert after["hybrid_pd_kv_pulls_total"] - before == 8  # every decode pulled its KV


def _flat(logprobs: dict) -> tuple[list[float], list[float]]:
    """An OpenAI completions logprobs object: the chosen tokens' values, and every
    position's alternatives' values best first, in one list."""
    tops = [sorted(t.values(), reverse=True) for t in logprobs["top_logprobs"]]
    return logprobs["token_logprobs"], [v for top in tops for v in top]


def _logprobs_equal_one_instance(pd, client, prompt) -> None:
    """Logprobs through the proxy and a P/D hand-off (the first token's from prefill, the
    rest from decode; whole and streamed), and prompt logprobs (echo), equal the single
    instance's: same tokens, same values."""
    body = {**_body(prompt, 6), "logprobs": 3}
    ref = pd.decode.complete(
        {**body, "model": pd.model, "prompt_logprobs": 3, "return_tokens_as_token_ids": True}
    )["choices"][0]
    want, want_top = _flat(ref["logprobs"])
    got = client.post("/v1/completions", json={**body, "model": "m"}).json()["choices"][0]
    assert got["token_ids"] == ref["token_ids"]
    values, top = _flat(got["logprobs"])
    assert values == pytest.approx(want) and top == pytest.approx(want_top)
    with client.stream("POST", "/v1/completions", json={**body, "model": "m", "stream": True}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    streamed = [v for ch in chunks for v in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(want)
    echo = {**body, "model": "m", "echo": True, "max_tokens": 2}
    scored = client.post("/v1/completions", json=echo).json()["choices"][0]["logprobs"]
    entries = ref["prompt_logprobs"]
    want_prompt = [None] + [entries[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))]
    assert scored["token_logprobs"][: len(prompt)] == pytest.approx(want_prompt)
    assert scored["token_logprobs"][len(prompt) :] == pytest.approx(want[:2])


def test_abort_by_id_drops_a_kept_prefill(pd):
    """Abort(request id) at the prefill server's VllmWorker drops the lease the vLLM
    connector keeps for a prefill it relayed: the blocks are free at once, not at expiry."""
    import grpc

    from hybrid_pd.connector.control import call_metadata
    from hybrid_pd.proto import worker_pb2 as wpb
    from hybrid_pd.proto import worker_pb2_grpc as wgrpc
    from hybrid_pd.workers.vllm_worker import VllmWorker

    shim = VllmWorker(pd.prefill.url, "prefill", pd.model, secret=pd.secret)
    before = _settle(pd.prefill, "vllm:kv_cache_usage_perc", 0.0)
    try:
        with grpc.insecure_channel(shim.address) as channel:
            stub = wgrpc.WorkerStub(channel)
            meta = call_metadata(pd.secret)
            reply = stub.Prefill(
                wpb.PrefillRequest(
                    request_id="abort-me",
                    prompt_ids=_prompts(4, seed=12)[3],
                    sampling=wpb.Sampling(max_tokens=8, top_p=1.0),
                ),
                metadata=meta,
                timeout=120,
            )
            assert reply.HasField("kv_transfer_params") and not reply.finished
            assert pd.prefill.metrics()["vllm:kv_cache_usage_perc"] > 0  # kept
            assert stub.Abort(wpb.AbortRequest(request_id="abort-me"), metadata=meta).ok
            assert not stub.Abort(wpb.AbortRequest(request_id="abort-me"), metadata=meta).ok
    finally:
        shim.close()
    after = _settle(pd.prefill, "vllm:kv_cache_usage_perc", 0.0, timeout=10.0)
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    aborted = after.get("hybrid_pd_kv_aborted_total", 0) - before.get(
        "hybrid_pd_kv_aborted_total", 0
    )
    assert aborted == 1


def _block_size(server: Server) -> int:
    """The attention block size vLLM settled on (raised to match state pages in hybrids)."""
    line = next(
        ln for ln in server.client.get("/metrics").text.splitlines()
        if ln.startswith("vllm:cache_config_info")
    )  # fmt: skip
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    return int(labels.get("effective_attention_block_size") or labels["block_size"])


def _minimum_bytes(model: Path, dtype: str, prompt_len: int, block_size: int) -> int:
    """What decode cannot do without, from the checkpoint's config alone: every full
    attention layer's blocks of the prompt, a sliding layer's blocks holding the window
    the next token attends to (positions N - window + 1 .. N - 1), one state per Mamba2 or
    Gated DeltaNet layer (conv inputs in the serving dtype; the SSM state in the config's
    `mamba_ssm_dtype`, else the serving dtype: vLLM 0.32's "auto")."""
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config") or cfg
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    n = prompt_len
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = block_size * 2 * cfg["num_key_value_heads"] * head_dim * size
    ssm = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.get("mamba_ssm_dtype") or dtype]
    total = 0
    for kind in cfg["layer_types"]:
        if kind in ("full_attention", "attention"):
            total += -(-n // block_size) * per_block
        elif kind == "sliding_attention":
            first = max(0, n - cfg["sliding_window"] + 1) // block_size
            total += ((n - 1) // block_size - first + 1) * per_block
        elif cfg["model_type"] == "granitemoehybrid":  # Mamba2 ("mamba" or linear_attention)
            heads, d_head, state = cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_d_state"]
            conv_dim = heads * d_head + 2 * cfg["mamba_n_groups"] * state
            total += conv_dim * (cfg["mamba_d_conv"] - 1) * size + heads * d_head * state * ssm
        elif kind == "linear_attention":  # Gated DeltaNet
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
            conv_dim = 2 * kh * dk + vh * dv
            total += conv_dim * (cfg["linear_conv_kernel_dim"] - 1) * size + vh * dk * dv * ssm
        else:
            raise AssertionError(f"no byte rule for layer kind {kind!r}")
    return total


def test_bytes_pulled_are_the_minimum(pd):
    """Per hand-off, the bytes decode pulls equal the minimum computed from the model's
    config: nothing decode does not read (blocks out of the window, speculative scratch
    states, padding) crosses."""
    block = _block_size(pd.decode)
    for prompt in _prompts(5, seed=13):
        want = _minimum_bytes(pd.model_path, pd.dtype, len(prompt), block)
        before = pd.decode.metrics()
        pulls = before.get("hybrid_pd_kv_pulls_total", 0.0)
        pd.run(prompt, max_tokens=2)
        after = _settle(pd.decode, "hybrid_pd_kv_pulls_total", pulls + 1)
        got = after["hybrid_pd_kv_bytes_pulled_total"] - before.get(
            "hybrid_pd_kv_bytes_pulled_total", 0.0
        )
        assert got == want, f"prompt of {len(prompt)} tokens (block size {block})"
