"""n-D box arithmetic. A box is a tuple of half-open (start, stop) ranges, one per dimension."""

from __future__ import annotations

from math import prod

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def translate(box: Box, delta: tuple[int, ...]) -> Box:
    return tuple((a + d, b + d) for (a, b), d in zip(box, delta, strict=True))


def relative(box: Box, origin: Box) -> Box:
    """`box` in the coordinates of `origin`'s corner (box lies inside origin)."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def is_contiguous(box: Box, shape: tuple[int, ...]) -> bool:
    """True when the box's elements are one run in the C-order flattening of a tensor of ``shape``:
    every dimension after the first one with extent > 1 is full."""
    seen_wide = False
    for (a, b), n in zip(box, shape, strict=True):
        if seen_wide and (a, b) != (0, n):
            return False
        if b - a > 1:
            seen_wide = True
    return True


def flat_start(box: Box, shape: tuple[int, ...]) -> int:
    """C-order offset of the box's first element in a tensor of ``shape``."""
    off = 0
    for (a, _), n in zip(box, shape, strict=True):
        off = off * n + a
    return off


def flat_range_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[Box]:
    """Split the C-order flat range [start, stop) of a tensor of ``shape`` into regular boxes, in order:
    a partial first row, the full rows, a partial last row (recursively in more dimensions).
    Every box is contiguous, so its C-order flattening is exactly its part of the range."""
    if start >= stop:
        return []
    if len(shape) == 0:
        return [()]
    if len(shape) == 1:
        return [((start, stop),)]
    row = prod(shape[1:])
    r0, o0 = divmod(start, row)
    r1, o1 = divmod(stop, row)
    inner = shape[1:]
    if r0 == r1:
        return [((r0, r0 + 1),) + b for b in flat_range_boxes(o0, o1, inner)]
    out: list[Box] = []
    if o0:
        out += [((r0, r0 + 1),) + b for b in flat_range_boxes(o0, row, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1),) + full_box(inner))
    if o1:
        out += [((r1, r1 + 1),) + b for b in flat_range_boxes(0, o1, inner)]
    return out


def contiguous_boxes(box: Box, shape: tuple[int, ...]) -> list[Box]:
    """Split a box into boxes that are each contiguous in a tensor of ``shape`` (in C order)."""
    if is_contiguous(box, shape):
        return [box]
    (a, b), rest = box[0], box[1:]
    return [((i, i + 1),) + sub for i in range(a, b) for sub in contiguous_boxes(rest, shape[1:])]
