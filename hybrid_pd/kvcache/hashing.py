"""Prefix-cache block hashes: a chain over full blocks of token ids."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block, chained on its parent so equal hashes mean equal prefixes."""
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return BlockHash(h.digest())


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, extra: bytes = b""
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block gets none)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
