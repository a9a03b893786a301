"""Which worker likely holds a prompt's prefix in its KV cache (KV-aware routing).

The proxy cannot see the workers' caches; it remembers what it sent where. Each worker has
a bounded LRU of chained block hashes: the hash of block i covers tokens [0, (i+1)*B), the
way the workers' own prefix caches key their blocks, so a match of k leading hashes means
the worker computed (or received) exactly those k*B tokens. What a worker has since evicted
the index still believes held: the match is a prediction, the worker's own lookup decides.

    record(worker, tokens)   after routing a request there (prompt, and prompt + answer)
    match(worker, tokens)    leading blocks of `tokens` the worker was sent before
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

#: Hashes remembered per worker (about 50 bytes each).
DEFAULT_CAPACITY = 1 << 16


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the whole blocks of `token_ids` (a partial last block has none)."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b",".join(str(t).encode() for t in token_ids[start : start + block_size]))
        parent = h.digest()
        out.append(parent)
    return out


class PrefixIndex:
    """Per worker address, the block hashes of the token sequences routed there. Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, address: str, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` were recorded for `address`. Query only."""
        with self._lock:
            seen = self._seen.get(address)
            if not seen:
                return 0
            n = 0
            for h in hashes:
                if h not in seen:
                    break
                n += 1
            return n

    def record(self, address: str, hashes: Sequence[bytes]) -> None:
        """Remember `hashes` for `address` (most recent last); the oldest go past capacity."""
        if not hashes:
            return
        with self._lock:
            seen = self._seen.setdefault(address, OrderedDict())
            for h in hashes:
                seen[h] = None
                seen.move_to_end(h)
            while len(seen) > self.capacity:
                seen.popitem(last=False)

    def forget(self, address: str) -> None:
        """Drop what is known of a worker (it left the pool or restarted: cache empty)."""
        with self._lock:
            self._seen.pop(address, None)

    def size(self, address: str) -> int:
        with self._lock:
            return len(self._seen.get(address, ()))
