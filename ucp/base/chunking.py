"""How an atom is cut into stored objects (chunks) and, inside each, into independently readable inner chunks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class ChunkingPolicy:
    """Target sizes: `object_bytes` per stored object (one write each), `inner_bytes` per inner chunk
    (the unit a partial read fetches and a checksum covers). Atoms of fewer than `pack_below` bytes are packed
    (their chunks written back to back into shared pack objects of up to `pack_bytes`, `ucp.format.packs`): per-object
    costs, not bytes, decide the speed of small objects. `pack_below=0` packs nothing."""

    object_bytes: int = 64 * MiB
    inner_bytes: int = 1 * MiB
    pack_below: int = 1 * MiB
    pack_bytes: int = 32 * MiB

    def __post_init__(self) -> None:
        for name in ("object_bytes", "inner_bytes", "pack_below", "pack_bytes"):
            value = getattr(self, name)
            low = 0 if name == "pack_below" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(
                    f"ChunkingPolicy.{name} must be a {'non-negative' if low == 0 else 'positive'} "
                    f"number of bytes, got {value!r}"
                )

    def packs(self, nbytes: int) -> bool:
        """Whether an atom of `nbytes` bytes is packed."""
        return nbytes < self.pack_below


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= limit:
                    best = c
    return best


def fit_block(
    shape: Sequence[int],
    unit_bytes: int,
    target: int,
    periods: Sequence[int | None] | None = None,
    order: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The largest block of `shape` of at most `target` bytes (at least one unit).

    Dimensions are taken whole in `order` (default: last to first, i.e. C order); the first that does not fit
    gets a partial extent and the rest get one. Where `periods[d]` is set, the extent along d divides it, so no
    block ever crosses a multiple of the period (a boundary between two writers).
    """
    block = [1] * len(shape)
    size = unit_bytes
    for d in order if order is not None else reversed(range(len(shape))):
        n = max(shape[d], 1)
        period = periods[d] if periods else None
        limit = min(period, n) if period else n
        if size * limit <= target:
            block[d] = limit
            size *= limit
            if limit < n:
                break
            continue
        per = max(1, target // size)
        if period:
            block[d] = _largest_divisor_at_most(limit, per)
        else:
            pieces = -(-n // per)
            block[d] = -(-n // pieces)  # balanced, so the edge chunk carries little padding
        break
    return tuple(block)


# Inner chunks cut a writer's part of the split dimension at least this finely, so that a layout with up to
# this many times the writer's TP degree still reads whole inner chunks.
SPLIT_REFINEMENT = 4


def _finer(periods: Sequence[int | None] | None, split_dim: int | None) -> list[int | None] | None:
    if periods is None or split_dim is None or not periods[split_dim]:
        return None if periods is None else list(periods)
    refined = list(periods)
    p: int = periods[split_dim]  # type: ignore[assignment]  # (checked above)
    refined[split_dim] = next(p // k for k in range(SPLIT_REFINEMENT, 0, -1) if p % k == 0)
    return refined


def choose_chunks(
    shape: tuple[int, ...],
    itemsize: int,
    policy: ChunkingPolicy,
    periods: Sequence[int | None] | None = None,
    split_dim: int | None = None,
    packed: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(chunk_shape, inner_chunk_shape or None) for an array of `shape`.

    `periods` keeps chunk boundaries on writer boundaries (distributed saves); `split_dim` is the dimension
    that parallel layouts cut, cut first here too so that other layouts read few bytes they do not need.
    A `packed` atom has plain chunks only, as large as the writers' boundaries allow (one, without periods).
    """
    order = None
    if split_dim is not None:
        order = [d for d in reversed(range(len(shape))) if d != split_dim] + [split_dim]
    if packed:
        return fit_block(shape, itemsize, policy.object_bytes, periods, order), None
    inner = fit_block(shape, itemsize, policy.inner_bytes, _finer(periods, split_dim), order)
    grid = tuple(-(-max(s, 1) // i) for s, i in zip(shape, inner))
    grid_periods = [p // i if p else None for p, i in zip(periods, inner)] if periods else None
    per_object = fit_block(grid, math.prod(inner) * itemsize, policy.object_bytes, grid_periods, order)
    if all(g == 1 for g in per_object):
        return inner, None
    return tuple(i * g for i, g in zip(inner, per_object)), inner
