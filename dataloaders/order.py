"""The global sample order: a pure function of (seed, epoch, manifest hash), independent of ranks and workers.

Global position ``p`` (counting samples over all epochs) is sample ``perm_e[p % N]`` of epoch ``e = p // N``,
where ``perm_e`` is a permutation drawn from numpy's PCG64 seeded with ``(seed, e, manifest hash)``. Positions
run on across epoch boundaries, so no sample is skipped at the end of an epoch and a resume needs only ``p``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from .errors import DataLoaderError


class EpochOrder:
    def __init__(self, num_samples: int, seed: int, manifest_hash: str, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise DataLoaderError(f"a dataset with {num_samples} samples cannot be iterated")
        if seed < 0:
            raise DataLoaderError(f"seed must be non-negative, got {seed}")
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
