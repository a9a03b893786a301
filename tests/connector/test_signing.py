"""Signed kv_transfer_params and the decode side's admission of prefill addresses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybrid_pd.api.params import KVTransferParams
from hybrid_pd.api.signing import refusal, sign
from hybrid_pd.connector.admission import Admission
from hybrid_pd.connector.base import TransferFailed

SECRET = "s3cret"
NOW = 1_800_000_000.0


def _params(**kw) -> KVTransferParams:
    base = KVTransferParams(
        "r1", ((1, 2), (3,)), 10, 42, "prefill-x", "127.0.0.1:7001", "f" * 32, "tok", "d" * 32
    )
    return replace(base, **kw)


def test_signed_params_verify_and_survive_json_and_proto():
    signed = sign(_params(), SECRET, 30.0, now=NOW)
    assert signed.expires_at == NOW + 30.0 and len(signed.signature) == 64
    assert refusal(signed, SECRET, now=NOW + 29.0) is None
    via_json = KVTransferParams.from_dict(json.loads(json.dumps(signed.to_dict())))
    via_pb = KVTransferParams.from_pb(signed.to_pb())
    for copy in (via_json, via_pb):
        assert copy == signed and refusal(copy, SECRET, now=NOW) is None


@pytest.mark.parametrize(
    "change",
    [
        {"control_address": "127.0.0.1:7002"},
        {"request_id": "r2"},
        {"transfer_token": "other"},
        {"first_token": 43},
        {"block_ids": ((1, 2), (4,))},
        {"prompt_digest": "e" * 32},
        {"fingerprint": "0" * 32},
        {"expires_at": NOW + 3600.0},  # a later expiry is a different message
    ],
)
def test_any_altered_field_breaks_the_signature(change):
    altered = replace(sign(_params(), SECRET, 30.0, now=NOW), **change)
    assert "does not match" in refusal(altered, SECRET, now=NOW)


def test_expired_unsigned_and_wrong_secret_are_refused():
    signed = sign(_params(), SECRET, 30.0, now=NOW)
    assert "expired" in refusal(signed, SECRET, now=NOW + 30.0)
    assert "does not match" in refusal(signed, "other secret", now=NOW)
    assert "no shared secret" in refusal(signed, None, now=NOW)
    assert "not signed" in refusal(_params(), SECRET, now=NOW)
    with pytest.raises(ValueError, match="signature and expires_at"):
        _params(signature="ab").validated()  # half-signed params do not parse
    with pytest.raises(ValueError, match="signature and expires_at"):
        KVTransferParams.from_dict(_params().to_dict() | {"expires_at": NOW})
    with pytest.raises(ValueError, match="expires_at"):
        KVTransferParams.from_dict(signed.to_dict() | {"expires_at": "soon"})


def test_admission_known_vouched_replayed():
    clock = [NOW]
    adm = Admission(["127.0.0.1:7000"], SECRET, clock=lambda: clock[0])
    known = _params(control_address="127.0.0.1:7000")
    adm.admit(known)  # a known peer needs no signature
    with pytest.raises(TransferFailed, match="not a known prefill worker"):
        adm.admit(_params())
    forged = replace(sign(_params(), SECRET, 30.0, now=NOW), first_token=7)
    with pytest.raises(TransferFailed, match="does not match"):
        adm.admit(forged)
    assert not adm.may_dial("127.0.0.1:7001")  # refusals vouch for nothing
    signed = sign(_params(), SECRET, 30.0, now=NOW)
    adm.admit(signed)
    assert adm.may_dial("127.0.0.1:7001") and adm.known == ["127.0.0.1:7000"]
    adm.spend(signed)  # its pull succeeded
    with pytest.raises(TransferFailed, match="replay"):
        adm.admit(signed)
    # another request's signed params from the same server: admitted; a rank's address
    # vouched for by rank 0's params
    other = sign(_params(request_id="r2", transfer_token="t2"), SECRET, 30.0, now=NOW)
    adm.admit(other, "127.0.0.1:7002")
    assert adm.may_dial("127.0.0.1:7002")
    clock[0] = NOW + 31.0  # the vouchers expired: the addresses are unknown again
    assert not adm.may_dial("127.0.0.1:7001") and not adm.may_dial("127.0.0.1:7002")
    with pytest.raises(TransferFailed, match="expired"):
        adm.admit(sign(_params(request_id="r3"), SECRET, 30.0, now=NOW))


def test_admission_without_a_secret_admits_only_known_peers():
    adm = Admission([], None)
    with pytest.raises(TransferFailed, match="no shared secret"):
        adm.admit(sign(_params(), SECRET, 30.0))
