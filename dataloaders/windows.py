"""Samples read by windows: the unit that the windowed order keeps together, read and cached whole.

Window ``w`` holds samples ``[wW, (w+1)W)``, that is tokens ``[wWL, (w+1)WL + 1)`` of the stream (the last
sample's label included): one exact byte range of each shard it covers, read in one request per shard piece
(through the node's disk cache when there is one) and kept in memory while the rank's lanes still draw from it.
A sample never spans two windows, so a rank that reads whole windows reads nothing twice and nothing it does not
use, however the windows fall on block or shard boundaries.
"""

from __future__ import annotations

import logging

import numpy as np

from .blockcache import MemoryCache
from .corpus import Corpus

log = logging.getLogger(__name__)


def window_nbytes(window: int, seq_len: int, dtype: np.dtype) -> int:
    """The bytes of one whole window of ``window`` samples: its tokens and the last sample's label."""
    return (window * seq_len + 1) * dtype.itemsize


class WindowReader:
    """Rows ``[n, seq_len + 1]`` of samples, read by whole windows of ``window`` samples through a memory cache."""

    def __init__(self, corpus: Corpus, seq_len: int, window: int, num_samples: int, capacity_bytes: int) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.window = window
        self.num_samples = num_samples
        self.dtype = corpus.dtype
        self.window_bytes = window_nbytes(window, seq_len, self.dtype)
        self.capacity_bytes = capacity_bytes
        self.cache = MemoryCache(capacity_bytes, corpus.stats)

    def token_range(self, w: int) -> tuple[int, int]:
        first, stop = w * self.window, min((w + 1) * self.window, self.num_samples)
        return first * self.seq_len, stop * self.seq_len + 1

    def _fetch(self, windows: list) -> list[np.ndarray]:
        return self.corpus.read([self.token_range(int(w)) for w in windows], exact=True, dtype=self.dtype)

    def read(self, sample_ids: np.ndarray) -> np.ndarray:
        L = self.seq_len
        ids = np.asarray(sample_ids, dtype=np.int64)
        windows = ids // self.window
        have = self.cache.get_many(windows.tolist(), self._fetch)
        out = np.empty((ids.shape[0], L + 1), dtype=np.int64)
        for row, (i, w) in enumerate(zip(ids.tolist(), windows.tolist(), strict=True)):
            start = (i - w * self.window) * L
            out[row] = have[w][start : start + L + 1]
        return out
