"""How an atom is cut into stored objects (chunks) and, inside each, into independently readable inner chunks."""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class ChunkingPolicy:
    """Target sizes: `object_bytes` per stored object (one write each), `inner_bytes` per inner chunk
    (the unit a partial read fetches and a checksum covers)."""

    object_bytes: int = 64 * MiB
    inner_bytes: int = 1 * MiB


def fit_block(shape: tuple[int, ...], unit_bytes: int, target: int) -> tuple[int, ...]:
    """The largest C-order block of `shape` of at most `target` bytes (at least one unit): full trailing
    dimensions, a balanced partial extent in one dimension, ones before it."""
    block = [1] * len(shape)
    size = unit_bytes
    for d in reversed(range(len(shape))):
        n = max(shape[d], 1)
        if size * n <= target:
            block[d] = n
            size *= n
            continue
        per = max(1, target // size)
        pieces = -(-n // per)
        block[d] = -(-n // pieces)  # balanced, so the edge chunk carries little padding
        break
    return tuple(block)


def choose_chunks(shape: tuple[int, ...], itemsize: int, policy: ChunkingPolicy) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(chunk_shape, inner_chunk_shape or None) for an array of `shape`."""
    inner = fit_block(shape, itemsize, policy.inner_bytes)
    grid = tuple(-(-max(s, 1) // i) for s, i in zip(shape, inner))
    per_object = fit_block(grid, math.prod(inner) * itemsize, policy.object_bytes)
    if all(g == 1 for g in per_object):
        return inner, None
    return tuple(i * g for i, g in zip(inner, per_object)), inner
