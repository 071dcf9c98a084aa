"""A set of request ids that stays small for tens of millions of ids.

Resume needs the ids already written and duplicate detection needs the ids already read; as Python
strings 10 million ids take about a gigabyte. Here each id is a 12-byte BLAKE2b digest: new ones
go to a small Python set that is merged, when it grows, into a sorted numpy array searched by
bisection. 10 million ids take ~120 MB; a false "already seen" needs a 96-bit collision (about
1e-15 at that size).
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np

DIGEST_BYTES = 12
_DTYPE = f"S{DIGEST_BYTES}"


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES).digest()


class IdSet:
    def __init__(self, ids: Iterable[str] = (), merge_at: int = 1 << 18):
        self._recent: set[bytes] = set()
        self._sorted = np.empty(0, dtype=_DTYPE)
        self._merge_at = merge_at
        for key in ids:
            self.add(key)

    def add(self, key: str) -> bool:
        """Adds `key`; False if it was already there."""
        digest = _digest(key)
        if digest in self._recent or self._in_sorted(digest):
            return False
        self._recent.add(digest)
        if len(self._recent) >= self._merge_at:
            self._merge()
        return True

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        digest = _digest(key)
        return digest in self._recent or self._in_sorted(digest)

    def __len__(self) -> int:
        return len(self._recent) + len(self._sorted)

    def _in_sorted(self, digest: bytes) -> bool:
        if not len(self._sorted):
            return False
        # numpy's S dtype drops trailing NUL bytes when comparing; pad both sides the same way
        index = int(np.searchsorted(self._sorted, np.array(digest, dtype=_DTYPE)))
        return index < len(self._sorted) and self._sorted[index] == np.array(digest, dtype=_DTYPE)

    def _merge(self) -> None:
        fresh = np.array(sorted(self._recent), dtype=_DTYPE)
        self._sorted = np.union1d(self._sorted, fresh) if len(self._sorted) else fresh
        self._recent.clear()
