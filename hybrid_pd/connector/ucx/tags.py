"""Wire tags: the user's tag mixed with the sender's identity (see the package docstring).

UCX matches tags per worker, not per endpoint, so every wire tag carries a 64-bit hash of
the sender's worker address; both sides compute it from the same address bytes.
"""

from __future__ import annotations

import hashlib

TAG_SPACE = 1 << 64


def sender_key(address: bytes) -> int:
    """The 64-bit value XORed into wire tags of messages sent by the worker at `address`."""
    return int.from_bytes(hashlib.blake2b(bytes(address), digest_size=8).digest(), "little")


def wire_tags(sender_address: bytes, tag: int, count: int) -> list[int]:
    """Wire tags of `count` messages with user tags tag, tag+1, ... from `sender_address`."""
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise TypeError(f"tag must be an int, not {type(tag).__name__}")
    if tag < 0 or tag + count > TAG_SPACE:
        raise ValueError(f"tags {tag}..{tag + count - 1} do not fit in 64 bits")
    key = sender_key(sender_address)
    return [(tag + i) ^ key for i in range(count)]
