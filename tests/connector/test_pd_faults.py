"""Failures around a KV hand-over: each ends in the documented behaviour, no block leaked.

Decode's policy on a failed pull: `recompute` (run the prompt locally; output unchanged) or
`fail` (a clear error). Prefill frees kept blocks on release, abort or lease expiry.
"""

from __future__ import annotations

import socket
import time
from dataclasses import replace

import grpc
import pytest

from hybrid_pd.api.signing import sign
from hybrid_pd.api.wire import sampling_to_pb
from hybrid_pd.engine.sampling import SamplingParams
from hybrid_pd.launcher.local import start_worker
from hybrid_pd.proxy.worker_client import WorkerClient
from tests.checkpoints import qwen3_5
from tests.connector.pd_fixtures import (
    KV_MEMORY,
    no_leaks,
    prompt,
    reference_engine,
    reference_tokens,
    wait_until,
)

pytestmark = pytest.mark.slow

N_NEW = 8
LEASE_S = "2.0"
SAMPLING = sampling_to_pb(SamplingParams(max_tokens=N_NEW, ignore_eos=True))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = qwen3_5(tmp_path_factory.mktemp("ckpt"))
    common = ["--model", str(path), "--kv-memory", KV_MEMORY, "--threads", "1"]
    procs = {}
    try:
        procs["prefill"] = start_worker("prefill", *common, "--lease-s", LEASE_S)
        peer = ("--peer", procs["prefill"].address)
        procs["decode"] = start_worker("decode", *common, *peer, "--transfer-timeout-s", "10")
        procs["decode_other_layout"] = start_worker("decode", *common, *peer, "--block-size", "16")
        clients = {k: WorkerClient(p.address, timeout_s=60) for k, p in procs.items()}
        yield path, common, procs, clients, reference_engine(path)
    finally:
        for p in procs.values():
            p.stop()


def _expected(ref, p):
    return reference_tokens(ref, p, N_NEW)


def _leak_free(*clients):
    for c in clients:
        wait_until(lambda c=c: no_leaks(c.stats()), 15, f"{c.address} to free every block")


def test_wrong_transfer_token(env):
    _, _, _, c, ref = env
    p = prompt(40, seed=11)
    first = c["prefill"].prefill("tok-1", p, SAMPLING)
    spoofed = replace(first.kv_transfer_params, transfer_token="not-the-token")
    with pytest.raises(grpc.RpcError, match="wrong transfer token") as e:
        c["decode"].generate("tok-1", p, SAMPLING, spoofed, failure_policy="fail")
    # ABORTED: the decode worker is alive (the proxy must not take it for dead).
    assert e.value.code() == grpc.StatusCode.ABORTED
    out = c["decode"].generate("tok-1b", p, SAMPLING, spoofed, failure_policy="recompute")
    assert out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
    assert c["prefill"].stats()["prefill_connector"]["bad_token"] >= 2
    _leak_free(c["prefill"], c["decode"])  # the real lease expires after 2 s


def test_abort_frees_kept_blocks(env):
    _, _, _, c, ref = env
    p = prompt(30, seed=12)
    first = c["prefill"].prefill("ab-1", p, SAMPLING)
    assert c["prefill"].stats()["leases"] == 1
    # This worker runs without a secret: nobody may abort by id alone (another client's
    # request), only with the request's transfer token.
    with pytest.raises(grpc.RpcError) as e:
        c["prefill"].abort("ab-1")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError):
        c["prefill"].abort("ab-1", transfer_token="not-the-token")
    assert c["prefill"].stats()["leases"] == 1
    token = first.kv_transfer_params.transfer_token
    assert c["prefill"].abort("ab-1", transfer_token=token)
    wait_until(lambda: no_leaks(c["prefill"].stats()), 5, "the aborted lease to be freed")
    out = c["decode"].generate("ab-1", p, SAMPLING, first.kv_transfer_params)
    assert out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
    _leak_free(c["decode"])


def test_lease_expiry(env):
    _, _, _, c, _ = env
    p = prompt(25, seed=13)
    first = c["prefill"].prefill("exp-1", p, SAMPLING)
    _leak_free(c["prefill"])  # nobody pulled: the lease ran out and the blocks came back
    assert c["prefill"].stats()["prefill_connector"]["expired"] >= 1
    with pytest.raises(grpc.RpcError, match="no KV kept"):
        c["decode"].generate("exp-1", p, SAMPLING, first.kv_transfer_params, failure_policy="fail")
    _leak_free(c["decode"])


def test_layout_mismatch_is_refused_by_name(env):
    _, _, _, c, ref = env
    p = prompt(33, seed=14)
    first = c["prefill"].prefill("lay-1", p, SAMPLING)
    with pytest.raises(grpc.RpcError, match="block_size") as e:
        c["decode_other_layout"].generate(
            "lay-1", p, SAMPLING, first.kv_transfer_params, failure_policy="fail"
        )
    assert "layout" in e.value.details().lower()
    out = c["decode_other_layout"].generate("lay-2", p, SAMPLING, first.kv_transfer_params)
    assert out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
    # The refusing decode worker told the prefill worker to drop the lease (an Abort needs
    # no handshake): nothing is left kept for a pull that will never come.
    _leak_free(c["prefill"], c["decode_other_layout"])


@pytest.mark.parametrize("when", ["before", "known", "during"])
def test_prefill_killed(env, when):
    """A prefill worker killed before the pull (never met, or `known`: decode holds its
    memory's keys from an earlier pull, and must not read a dead process) or during it
    (one-sided: after decode read, before the prefill worker confirmed): the pull fails
    with the prefill worker named, decode lives on and recomputes exactly."""
    _, common, _, c, ref = env
    fault = {"HYBRID_PD_INJECT_FAULT": "exit_during_pull"} if when == "during" else {}
    doomed = start_worker("prefill", *common, env=fault)
    try:
        c["decode"].add_peers([doomed.address])
        client = WorkerClient(doomed.address, timeout_s=60)
        p = prompt(70, seed=15)
        if when == "known":
            first = client.prefill("kill-known-0", p, SAMPLING)
            out = c["decode"].generate("kill-known-0", p, SAMPLING, first.kv_transfer_params)
            assert not out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
        first = client.prefill(f"kill-{when}", p, SAMPLING)
        if when in ("before", "known"):
            doomed.kill()
        with pytest.raises(grpc.RpcError) as e:
            c["decode"].generate(
                f"kill-{when}", p, SAMPLING, first.kv_transfer_params, failure_policy="fail"
            )
        assert "prefill worker" in e.value.details()
        if when == "during":
            assert doomed.proc.wait(10) == 17  # it really died in the middle of the pull
        out = c["decode"].generate(f"kill-{when}-2", p, SAMPLING, first.kv_transfer_params)
        assert out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
    finally:
        doomed.stop()
    _leak_free(c["decode"])


@pytest.fixture(scope="module")
def secured(env):
    """A prefill worker and two decode workers sharing a secret: one told of the prefill
    worker (--peer), one told of none."""
    _, common, _, _, _ = env
    procs = []
    try:
        procs.append(start_worker("prefill", *common, "--secret", "s3cret"))
        peer = ("--peer", procs[0].address)
        procs.append(start_worker("decode", *common, *peer, "--secret", "s3cret"))
        procs.append(start_worker("decode", *common, "--secret", "s3cret"))
        yield procs
    finally:
        for w in procs:
            w.stop()


def test_shared_secret_guards_every_rpc(env, secured):
    ref = env[4]
    procs = secured
    p = prompt(20, seed=16)
    with pytest.raises(grpc.RpcError) as e:
        WorkerClient(procs[0].address).prefill("sec-0", p, SAMPLING)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for rpc in ("stats", "health"):
        with pytest.raises(grpc.RpcError) as e:
            getattr(WorkerClient(procs[1].address), rpc)()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    prefill, decode = (WorkerClient(w.address, secret="s3cret") for w in procs[:2])
    first = prefill.prefill("sec-1", p, SAMPLING)
    with pytest.raises(grpc.RpcError) as e:  # Abort without the secret: refused
        WorkerClient(procs[0].address).abort("sec-1")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    out = decode.generate("sec-1", p, SAMPLING, first.kv_transfer_params)
    assert not out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
    _leak_free(prefill, decode)


def test_signed_params_open_an_unlisted_prefill_worker(env, secured):
    """A decode worker never told of a prefill worker pulls from it when the params are
    signed with the shared secret; forged, expired, unsigned and replayed params are
    refused before a byte moves (and a forged address is never dialed)."""
    ref = env[4]
    prefill, _, decode = (WorkerClient(w.address, secret="s3cret") for w in secured)
    assert decode.stats()["peers"] == []
    p = prompt(28, seed=19)
    first = prefill.prefill("sig-1", p, SAMPLING)
    kv = first.kv_transfer_params
    assert kv.signature and kv.expires_at > time.time()
    sent = prefill.stats()["prefill_connector"]["bytes_sent"]
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        trap.settimeout(0.5)
        elsewhere = f"127.0.0.1:{trap.getsockname()[1]}"
        for bad, why in (
            (replace(kv, control_address=elsewhere), "signature does not match"),
            (replace(kv, first_token=(kv.first_token + 1) % 256), "signature does not match"),
            (sign(replace(kv, signature="", expires_at=0.0), "s3cret", 1, time.time() - 5),
             "expired"),
            (sign(replace(kv, signature="", expires_at=0.0), "guess", 30), "does not match"),
            (replace(kv, signature="", expires_at=0.0), "not a known prefill worker"),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError, match=why):
                decode.generate("sig-1", p, SAMPLING, bad, failure_policy="fail")
        with pytest.raises(TimeoutError):
            trap.accept()
    assert prefill.stats()["prefill_connector"]["bytes_sent"] == sent
    assert decode.stats()["decode_connector"]["pulls"] == 0
    out = decode.generate("sig-1", p, SAMPLING, kv)
    assert not out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
    assert out.transfer["bytes"] > 0
    sent = prefill.stats()["prefill_connector"]["bytes_sent"]
    with pytest.raises(grpc.RpcError, match="replay"):
        decode.generate("sig-2", p, SAMPLING, kv, failure_policy="fail")
    assert prefill.stats()["prefill_connector"]["bytes_sent"] == sent
    _leak_free(prefill, decode)


def test_decode_never_dials_an_address_from_the_request(env):
    """kv_transfer_params naming an address the decode worker does not know as a prefill
    worker: refused without a single connection there (the secret would go with it)."""
    _, _, _, c, ref = env
    p = prompt(36, seed=17)
    first = c["prefill"].prefill("dial-1", p, SAMPLING)
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        trap.settimeout(0.5)
        elsewhere = f"127.0.0.1:{trap.getsockname()[1]}"
        spoofed = replace(first.kv_transfer_params, control_address=elsewhere)
        with pytest.raises(grpc.RpcError, match="not a known prefill worker"):
            c["decode"].generate("dial-1", p, SAMPLING, spoofed, failure_policy="fail")
        out = c["decode"].generate("dial-2", p, SAMPLING, spoofed)  # recompute: still exact
        assert out.transfer["recomputed"] and out.token_ids == _expected(ref, p)
        with pytest.raises(TimeoutError):
            trap.accept()
    c["prefill"].abort("dial-1", transfer_token=first.kv_transfer_params.transfer_token)
    _leak_free(c["prefill"], c["decode"])


def test_malformed_params_are_refused_by_field(env):
    """kv_transfer_params that cannot describe a hand-over: INVALID_ARGUMENT naming the
    field, before anything is queued; the real hand-over is still there to abort."""
    _, _, _, c, _ = env
    p = prompt(30, seed=18)
    first = c["prefill"].prefill("bad-1", p, SAMPLING)
    kv = first.kv_transfer_params
    for field, value in (
        ("prompt_len", 0),
        ("prompt_len", len(p) - 1),  # valid alone, but not this prompt's
        ("first_token", -1),
        ("block_ids", tuple((0, *g) for g in kv.block_ids)),
        ("request_id", ""),
        ("control_address", ""),
        ("fingerprint", ""),
        ("transfer_token", ""),
    ):
        with pytest.raises(grpc.RpcError) as e:
            c["decode"].generate("bad-1", p, SAMPLING, replace(kv, **{field: value}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert f"kv_transfer_params.{field}" in e.value.details(), e.value.details()
    assert c["prefill"].stats()["leases"] == 1
    assert c["prefill"].abort("bad-1", transfer_token=kv.transfer_token)
    _leak_free(c["prefill"], c["decode"])
