"""kv_transfer_params: what a decode worker needs to pull one request's KV.

On the wire between workers and the proxy it is the `KVTransferParams` proto message
(`to_pb` / `from_pb`); inside vLLM's own kv_transfer_params it is a JSON object
(`to_dict` / `from_dict`). Both parsers validate the same way and raise ValueError naming
the bad field.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from hybrid_pd.api.ids import EngineId, RequestId
from hybrid_pd.api.wire import same_named
from hybrid_pd.proto import worker_pb2 as pb

#: Fields that must be non-empty strings.
_STRINGS = ("request_id", "engine_id", "control_address", "fingerprint", "transfer_token")
_INTS = ("prompt_len", "first_token")


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Fingerprint of a prompt: decode refuses params made for another prompt."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


def _optional(d: dict, name: str, types, default):
    """`d[name]` when present (of `types`, not a bool), else `default`."""
    if name not in d:
        return default
    value = d[name]
    if not isinstance(value, types) or isinstance(value, bool):
        raise ValueError(f"kv_transfer_params.{name} has the wrong type")
    return value


@dataclass(frozen=True)
class KVTransferParams:
    request_id: RequestId
    #: Per KV cache group, the prefill worker's block ids decode needs (null blocks dropped):
    #: every block for full attention, the last window's blocks for sliding window, the
    #: state page(s) for Mamba/GDN. A group may be empty (nothing of it to ship).
    block_ids: tuple[tuple[int, ...], ...]
    prompt_len: int
    first_token: int
    engine_id: EngineId
    control_address: str
    fingerprint: str
    transfer_token: str
    #: `prompt_digest` of the prompt the params were made for ("" when the maker sets
    #: none): vLLM's connector refuses params whose digest is not its prompt's.
    prompt_digest: str = ""
    #: Made by the proxy while the prefill still runs (overlap): `block_ids`, `first_token`,
    #: `engine_id` and `fingerprint` are unknown until the prefill worker's Progress tells
    #: them (`completed`).
    staged: bool = False
    #: Wall-clock second after which the signature no longer vouches for the params, and
    #: the HMAC that does (`api.signing`); 0 and "" when unsigned.
    expires_at: float = 0.0
    signature: str = ""

    @classmethod
    def for_staging(
        cls,
        request_id: RequestId,
        prompt_ids: Sequence[int],
        control_address: str,
        transfer_token: str,
    ) -> KVTransferParams:
        """Params for a prefill that is still running (its Prefill carries the token)."""
        return cls(
            request_id=request_id,
            block_ids=(),
            prompt_len=len(prompt_ids),
            first_token=0,
            engine_id=EngineId(""),
            control_address=control_address,
            fingerprint="",
            transfer_token=transfer_token,
            prompt_digest=prompt_digest(prompt_ids),
            staged=True,
        ).validated()

    def completed(
        self,
        block_ids: Sequence[Sequence[int]],
        first_token: int,
        engine_id: EngineId,
        fingerprint: str,
    ) -> KVTransferParams:
        """The params once the prefill ended and kept its KV (validated)."""
        return replace(
            self,
            block_ids=tuple(tuple(g) for g in block_ids),
            first_token=first_token,
            engine_id=engine_id,
            fingerprint=fingerprint,
            staged=False,
            expires_at=0.0,
            signature="",
        ).validated()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["block_ids"] = [list(g) for g in self.block_ids]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> KVTransferParams:
        """Parse and validate a JSON object; raises ValueError naming the bad field."""
        if not isinstance(d, dict):
            raise ValueError("kv_transfer_params must be a JSON object")
        for name in (*_STRINGS, *_INTS):
            typ = str if name in _STRINGS else int
            if not isinstance(d.get(name), typ) or isinstance(d.get(name), bool):
                raise ValueError(f"kv_transfer_params.{name} is missing or not a {typ.__name__}")
        groups = d.get("block_ids")
        if not isinstance(groups, list) or not all(
            isinstance(g, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in g)
            for g in groups
        ):
            raise ValueError("kv_transfer_params.block_ids must be a list of lists of block ids")
        return cls(
            block_ids=tuple(tuple(g) for g in groups),
            **{name: d[name] for name in (*_STRINGS, *_INTS)},
            prompt_digest=d["prompt_digest"] if isinstance(d.get("prompt_digest"), str) else "",
            expires_at=_optional(d, "expires_at", (int, float), 0.0),
            signature=_optional(d, "signature", str, ""),
        ).validated()

    def to_pb(self) -> pb.KVTransferParams:
        return pb.KVTransferParams(
            block_ids=[pb.BlockIds(ids=g) for g in self.block_ids],
            **same_named(self, _AS_IS),
        )

    @classmethod
    def from_pb(cls, msg: pb.KVTransferParams) -> KVTransferParams:
        """Parse and validate the proto message; raises ValueError naming the bad field."""
        return cls(
            block_ids=tuple(tuple(g.ids) for g in msg.block_ids),
            **same_named(msg, _AS_IS),
        ).validated()

    def validated(self) -> KVTransferParams:
        """Self, when every field holds a usable value; else ValueError naming the field."""
        if self.staged and (self.block_ids or self.engine_id or self.fingerprint):
            raise ValueError(
                "staged kv_transfer_params carry no block_ids, engine_id or fingerprint"
            )
        for name in _STRINGS:
            if self.staged and name in ("engine_id", "fingerprint"):
                continue
            if not getattr(self, name):
                raise ValueError(f"kv_transfer_params.{name} is empty")
        if self.prompt_len < 1:
            raise ValueError("kv_transfer_params.prompt_len must be positive")
        if self.expires_at < 0 or (self.expires_at > 0) != bool(self.signature):
            raise ValueError("kv_transfer_params.signature and expires_at come together")
        if self.first_token < 0:
            raise ValueError("kv_transfer_params.first_token must not be negative")
        for g, ids in enumerate(self.block_ids):
            if any(b < 1 for b in ids):
                raise ValueError(f"kv_transfer_params.block_ids[{g}] holds a block id below 1")
        return self

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.block_ids)


#: Every field but `block_ids` (nested): the proto message carries each under its name.
_AS_IS = tuple(f.name for f in fields(KVTransferParams) if f.name != "block_ids")
