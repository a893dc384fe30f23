"""The sample orders: pure functions of (seed, epoch, dataset and the order's own parameters), never of the ranks.

Global position ``p`` (counting samples over all epochs) belongs to epoch ``e = p // N`` and is its sample
``order_e(p % N)``. Positions run on across epoch boundaries, so no sample is skipped at the end of an epoch and a
resume needs only ``p``. Each order also gives every position a *lane*: a global batch lays its samples out by lane
(stably, so by position within a lane) and each data-parallel rank takes a contiguous slice of that layout, so
that what a rank reads stays together in storage (see :class:`WindowOrder`).

- ``"global"`` (:class:`EpochOrder`): ``order_e`` is one permutation of all N samples drawn from PCG64 seeded with
  ``(seed, e, manifest hash)``: every batch is a uniform draw from the whole corpus, and every sample a rank reads
  is anywhere in storage. One lane.
- ``"none"`` (:class:`EpochOrder`, ``shuffle=False``): storage order. One lane.
- ``"windows"`` (:class:`WindowOrder`): local in storage; the default for corpora on object stores.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .errors import DataLoaderError

SHUFFLES = ("windows", "global", "none")
_WINDOWS_TAG = 0x77696E64  # keeps the windowed order's random streams apart from the global order's
_SPAN_TAG = 0x7370616E


def _check(num_samples: int, seed: int) -> None:
    if num_samples <= 0:
        raise DataLoaderError(f"a dataset with {num_samples} samples cannot be iterated")
    if seed < 0:
        raise DataLoaderError(f"seed must be non-negative, got {seed}")


class EpochOrder:
    """One uniform permutation of all samples per epoch (``shuffle=False``: storage order)."""

    def __init__(self, num_samples: int, seed: int, manifest_hash: str, shuffle: bool = True) -> None:
        _check(num_samples, seed)
        self.num_samples = num_samples
        self.seed = seed
        self.manifest_hash = manifest_hash
        self.shuffle = shuffle
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()  # the last two epochs: a batch may span both
        self._lock = threading.Lock()

    def permutation(self, epoch: int) -> np.ndarray:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                if self.shuffle:
                    ss = np.random.SeedSequence([self.seed, epoch, int(self.manifest_hash, 16)])
                    perm = np.random.Generator(np.random.PCG64(ss)).permutation(self.num_samples)
                else:
                    perm = np.arange(self.num_samples, dtype=np.int64)
                self._perms[epoch] = perm
                while len(self._perms) > 2:
                    self._perms.popitem(last=False)
            return perm

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(epoch, sample index)`` of each global position."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs = positions // self.num_samples
        ids = np.empty_like(positions)
        for e in np.unique(epochs):
            sel = epochs == e
            ids[sel] = self.permutation(int(e))[positions[sel] % self.num_samples]
        return epochs, ids

    def lanes(self, positions: np.ndarray) -> np.ndarray:
        return np.zeros(np.shape(positions), dtype=np.int64)

    def describe(self) -> dict:
        return {"mode": "global" if self.shuffle else "none"}


class WindowOrder:
    """A shuffle that is local in storage: windows of neighbouring samples, lanes, and spans within a lane.

    Epoch ``e`` of N samples, with ``W`` samples per window, ``K`` lanes and ``S`` samples per span:

    1. The windows (samples ``[wW, (w+1)W)``: one contiguous byte range of the corpus) are permuted (PCG64 seeded
       with ``(seed, e, manifest hash)``), and their samples concatenated in that order into a sequence ``T``.
    2. ``T`` is cut into ``K`` lanes of ``N // K`` or ``N // K + 1`` samples, lane ``k`` a contiguous run of it;
       odd lanes run backwards, so that two neighbouring lanes reach the window they share (the run's cut falls
       inside a window) at the same time, both at the start or both at the end of the epoch, and it is read once.
    3. Each lane is cut into spans of ``S`` samples, and the samples of each span are permuted (seeded with
       ``(seed, e, manifest hash, k, span)``).
    4. Position ``q = p % N`` of the epoch is sample ``i = q // K`` of lane ``k = q % K``.

    A global batch of G positions therefore holds G/K samples of each lane (K dividing G; with G dividing K, G
    lanes), each from the current span of its lane, that is from ``S / W`` random windows of the corpus. Laid out
    by lane, rank ``r`` of ``D`` (D dividing K) takes lanes ``[rK/D, (r+1)K/D)`` in every batch: over an epoch a
    contiguous run of ``T``, whole windows that no other rank reads. With G divisible by K (or K by G) and D
    dividing K, a rank's reads over an epoch are its own samples' bytes, plus at most two windows shared with its
    neighbours. Other sizes stay exact; they share more windows between ranks.
    """

    def __init__(
        self, num_samples: int, seed: int, manifest_hash: str, lanes: int = 64, window: int = 256, span: int = 1024
    ) -> None:
        _check(num_samples, seed)
        for name, value in (("lanes", lanes), ("window", window), ("span", span)):
            if not isinstance(value, int) or value <= 0:
                raise DataLoaderError(f"the windowed order's {name} must be a positive integer, got {value!r}")
        self.num_samples = num_samples
        self.seed = seed
        self.manifest_hash = manifest_hash
        self.num_lanes = lanes
        self.window = window
        self.span = span
        self.num_windows = -(-num_samples // window)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._spans: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def _seed(self, *words: int) -> np.random.Generator:
        ss = np.random.SeedSequence([self.seed, *words[:1], int(self.manifest_hash, 16), *words[1:]])
        return np.random.Generator(np.random.PCG64(ss))

    def _windows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The windows in epoch order, and where each one's samples start in ``T`` (one more: the end)."""
        got = self._epochs.get(epoch)
        if got is None:
            perm = self._seed(epoch, _WINDOWS_TAG).permutation(self.num_windows)
            sizes = np.full(self.num_windows, self.window, dtype=np.int64)
            sizes[-1] = self.num_samples - (self.num_windows - 1) * self.window
            starts = np.zeros(self.num_windows + 1, dtype=np.int64)
            np.cumsum(sizes[perm], out=starts[1:])
            got = self._epochs[epoch] = (perm, starts)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return got

    def lane_start(self, lane: np.ndarray | int) -> np.ndarray | int:
        """Where lane ``k`` starts in ``T``."""
        base, extra = divmod(self.num_samples, self.num_lanes)
        return lane * base + np.minimum(lane, extra)

    def lane_length(self, lane: int) -> int:
        base, extra = divmod(self.num_samples, self.num_lanes)
        return base + (1 if lane < extra else 0)

    def _span_perm(self, epoch: int, lane: int, span: int) -> np.ndarray:
        key = (epoch, lane, span)
        perm = self._spans.get(key)
        if perm is None:
            n = min(self.span, self.lane_length(lane) - span * self.span)
            perm = self._spans[key] = self._seed(epoch, _SPAN_TAG, lane, span).permutation(n)
            while len(self._spans) > 4 * self.num_lanes + 64:  # the spans of the lanes of two epochs, and slack
                self._spans.popitem(last=False)
        return perm

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(epoch, sample index)`` of each global position."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size == 0:
            return positions.copy(), positions.copy()
        N, K = self.num_samples, self.num_lanes
        epochs = positions // N
        q = positions % N
        lane, i = q % K, q // K
        span, offset = i // self.span, i % self.span
        t = np.empty_like(positions)  # index into T of each position
        ids = np.empty_like(positions)
        groups, which = np.unique(np.stack([epochs, lane, span], axis=1), axis=0, return_inverse=True)
        members = np.split(np.argsort(which, kind="stable"), np.cumsum(np.bincount(which.ravel()))[:-1])
        with self._lock:
            for (e, k, j), sel in zip(groups.tolist(), members, strict=True):
                u = j * self.span + self._span_perm(e, k, j)[offset[sel]]  # where in its lane's run of T
                if k % 2:
                    u = self.lane_length(k) - 1 - u
                t[sel] = self.lane_start(k) + u
            for e in np.unique(epochs):
                sel = epochs == e
                perm, starts = self._windows(int(e))
                where = np.searchsorted(starts, t[sel], side="right") - 1
                ids[sel] = perm[where] * self.window + (t[sel] - starts[where])
        return epochs, ids

    def lanes(self, positions: np.ndarray) -> np.ndarray:
        return (np.asarray(positions, dtype=np.int64) % self.num_samples) % self.num_lanes

    def describe(self) -> dict:
        return {"mode": "windows", "lanes": self.num_lanes, "window": self.window, "span": self.span}
