"""kv_transfer_params: what a decode worker needs to pull one request's KV (plain JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KVTransferParams:
    request_id: str
    #: Per KV cache group, the prefill worker's block ids decode needs (null blocks dropped):
    #: every block for full attention, the last window's blocks for sliding window, the
    #: state page(s) for Mamba/GDN.
    block_ids: tuple[tuple[int, ...], ...]
    prompt_len: int
    first_token: int
    engine_id: str
    control_address: str
    fingerprint: str
    transfer_token: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["block_ids"] = [list(g) for g in self.block_ids]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> KVTransferParams:
        """Parse and validate; raises ValueError naming the bad field."""
        if not isinstance(d, dict):
            raise ValueError("kv_transfer_params must be a JSON object")
        fields = {
            "request_id": str,
            "prompt_len": int,
            "first_token": int,
            "engine_id": str,
            "control_address": str,
            "fingerprint": str,
            "transfer_token": str,
        }
        for name, typ in fields.items():
            if not isinstance(d.get(name), typ) or isinstance(d.get(name), bool):
                raise ValueError(f"kv_transfer_params.{name} is missing or not a {typ.__name__}")
        groups = d.get("block_ids")
        if not isinstance(groups, list) or not all(
            isinstance(g, list) and all(isinstance(b, int) and b > 0 for b in g) for g in groups
        ):
            raise ValueError("kv_transfer_params.block_ids must be a list of lists of block ids")
        if d["prompt_len"] < 1:
            raise ValueError("kv_transfer_params.prompt_len must be positive")
        return cls(
            request_id=d["request_id"],
            block_ids=tuple(tuple(g) for g in groups),
            prompt_len=d["prompt_len"],
            first_token=d["first_token"],
            engine_id=d["engine_id"],
            control_address=d["control_address"],
            fingerprint=d["fingerprint"],
            transfer_token=d["transfer_token"],
        )

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.block_ids)
