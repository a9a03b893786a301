"""Signed kv_transfer_params: proof that a prefill server holding the shared secret made them.

A decode server dials only prefill servers it knows (its `peers`, or the proxy's registry),
because every control call carries the shared secret. Behind a router that scales prefill
servers up and down no static list stays current, so a prefill server that has the secret
signs the params it hands out: an HMAC-SHA256, keyed by the secret, over every field that
says what to pull and from where (address, request, transfer token, blocks, first token,
prompt digest, layout) and an expiry in wall-clock seconds. A decode server with the same
secret may then dial that address for those params; a forged, altered, expired or (after a
pull succeeded) replayed signature is refused before any connection is made.

Without a secret nothing is signed and only known peers are dialed, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import replace

from hybrid_pd.api.params import KVTransferParams

#: The signature's version tag: a later scheme signs under another tag.
_SCHEME = b"hybrid-pd-params-v1\n"


def _message(params: KVTransferParams) -> bytes:
    """The bytes signed: every field but the signature, in a fixed order and encoding."""
    fields = params.to_dict()
    fields.pop("signature", None)
    return _SCHEME + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _digest(params: KVTransferParams, secret: str) -> str:
    return hmac.new(secret.encode(), _message(params), hashlib.sha256).hexdigest()


def sign(
    params: KVTransferParams, secret: str, ttl_s: float, now: float | None = None
) -> KVTransferParams:
    """`params` with an expiry `ttl_s` seconds from `now` (wall clock) and their signature."""
    if ttl_s <= 0:
        raise ValueError("a signature's lifetime must be positive")
    at = time.time() if now is None else now
    dated = replace(params, expires_at=round(at + ttl_s, 3), signature="")
    return replace(dated, signature=_digest(dated, secret))


def refusal(params: KVTransferParams, secret: str | None, now: float | None = None) -> str | None:
    """Why signed `params` do not prove their origin (None: they do). Checks the signature
    first, so an altered expiry reads as a bad signature."""
    if not params.signature:
        return "the kv_transfer_params are not signed"
    if secret is None:
        return "this server has no shared secret to check the params' signature with"
    if not hmac.compare_digest(params.signature, _digest(params, secret)):
        return "the kv_transfer_params' signature does not match their fields"
    at = time.time() if now is None else now
    if params.expires_at <= at:
        return f"the kv_transfer_params' signature expired {at - params.expires_at:.1f} s ago"
    return None
