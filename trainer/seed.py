"""Seeds derived from one run seed, so that every random stream is a pure function of (seed, what it is for)."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, key: str) -> int:
    """A 63-bit seed for the stream named `key` (an atom name, a sample index, ...)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
