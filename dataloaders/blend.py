"""Deterministic blending of several datasets with weights.

Global position ``p`` goes to the source ``i`` that maximises ``w_i * (p + 1) - c_i`` (``c_i``: samples already
taken from source ``i``; ties to the lowest index), Megatron's greedy rule. Given the counters the rest of the
schedule is fixed, so the per-source counters in a loader state are all a resume needs, and each source's
share stays within one sample of ``w_i * p`` at every prefix.
"""

from __future__ import annotations

import numpy as np

from .errors import DataLoaderError


def normalize_weights(weights: list[float], n: int) -> list[float]:
    if len(weights) != n:
        raise DataLoaderError(f"{len(weights)} blend weights for {n} datasets")
    if any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise DataLoaderError(f"blend weights must be non-negative with a positive sum, got {weights}")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def blend_schedule(
    weights: list[float], counts: list[int], start: int, n: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Assign global positions ``[start, start + n)``.

    Returns ``(source of each position, that source's own position, counters after)``.
    """
    counts = list(counts)
    if sum(counts) != start:
        raise DataLoaderError(f"blend counters {counts} do not add up to the consumed samples {start}")
    src = np.empty(n, dtype=np.int64)
    local = np.empty(n, dtype=np.int64)
    k = len(weights)
    for j in range(n):
        p1 = start + j + 1
        best, best_err = 0, weights[0] * p1 - counts[0]
        for i in range(1, k):
            err = weights[i] * p1 - counts[i]
            if err > best_err:
                best, best_err = i, err
        src[j] = best
        local[j] = counts[best]
        counts[best] += 1
    return src, local, counts
