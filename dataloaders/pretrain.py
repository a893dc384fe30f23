"""The pretraining loader: fixed-length samples over documents concatenated in shard order (Megatron-style).

Sample ``i`` is tokens ``[i*L, i*L + L + 1)`` of the concatenated stream: ``L`` inputs and the ``L`` labels
shifted by one, so consecutive samples share one boundary token and a sample may span documents and shards.
Which sample each position is comes from the order (:mod:`.order`): ``"windows"`` (local in storage, read by
whole windows, :mod:`.windows`), ``"global"`` (one uniform permutation per epoch, read through the block cache)
or ``"none"``.
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np

from .blockcache import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_BYTES
from .corpus import Corpus, open_corpus
from .diskcache import DiskCache
from .errors import DataLoaderError
from .fetch import IOStats
from .loader import ElasticLoader, check_batch, datasets_of
from .order import SHUFFLES, EpochOrder, WindowOrder
from .windows import WindowReader, window_nbytes

log = logging.getLogger(__name__)

DEFAULT_LANES = 64
DEFAULT_WINDOW_BYTES = 1 << 20
DEFAULT_SPAN_WINDOWS = 4
DEFAULT_DISK_CACHE_BYTES = 16 << 30
MIN_LANE_WINDOWS = 4


class PretrainSource:
    kind = "pretrain"

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        seed: int = 0,
        shuffle: str = "windows",
        lanes: int = DEFAULT_LANES,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        span_windows: int = DEFAULT_SPAN_WINDOWS,
        cache_bytes: int | None = None,
        ranks: int = 1,
    ) -> None:
        if seq_len <= 0:
            raise DataLoaderError(f"seq_len must be positive, got {seq_len}")
        if shuffle not in SHUFFLES:
            raise DataLoaderError(f"shuffle must be one of {', '.join(map(repr, SHUFFLES))}, got {shuffle!r}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.manifest_hash = corpus.manifest.hash
        self.num_samples = (corpus.num_tokens - 1) // seq_len
        if self.num_samples <= 0:
            raise DataLoaderError(
                f"dataset {self.manifest_hash} has {corpus.num_tokens} tokens: too few for one sample of "
                f"{seq_len} + 1 tokens"
            )
        self.order: EpochOrder | WindowOrder
        self.windows: WindowReader | None = None
        if shuffle == "windows":
            if window_bytes <= 0 or span_windows <= 0 or lanes <= 0:
                raise DataLoaderError(
                    f"lanes, window_bytes and span_windows must be positive, got {lanes}, {window_bytes} and "
                    f"{span_windows}"
                )
            # A lane holds at least MIN_LANE_WINDOWS windows: a rank reads its own run of windows plus at most the two
            # it shares with its neighbours, so a window as large as a lane (a small corpus) would read twice the bytes.
            window = max(
                1,
                min(window_bytes // (seq_len * corpus.dtype.itemsize), self.num_samples // (MIN_LANE_WINDOWS * lanes)),
            )
            self.order = WindowOrder(self.num_samples, seed, self.manifest_hash, lanes, window, window * span_windows)
            nbytes = window_nbytes(window, seq_len, corpus.dtype)
            needed = self.working_set(nbytes, ranks)
            if cache_bytes is None:
                cache_bytes = needed
            elif cache_bytes < needed:
                log.warning(
                    "cache_bytes=%d is below what one rank of %d draws from at once in the windowed order "
                    "(%d bytes: %d lanes, %d windows of %d bytes each): windows will be read more than once",
                    cache_bytes, ranks, needed, self.lanes_per_rank(ranks), needed // nbytes, nbytes,
                )  # fmt: skip
            self.windows = WindowReader(corpus, seq_len, window, self.num_samples, cache_bytes)
        else:
            self.order = EpochOrder(self.num_samples, seed, self.manifest_hash, shuffle == "global")

    def lanes_per_rank(self, ranks: int) -> int:
        """How many lanes one of ``ranks`` ranks draws from over an epoch."""
        assert isinstance(self.order, WindowOrder)
        lanes = self.order.num_lanes
        return min(lanes, lanes // ranks if lanes % ranks == 0 else math.ceil(lanes / ranks) + 1)

    def working_set(self, window_bytes: int, ranks: int) -> int:
        """The memory in which one rank reads every window once: each of its lanes draws at random from the windows
        of its current span (``span / window`` of them, one more where the span starts inside a window), and room
        for as many again, so that the windows of the span just finished (used last, but no more) leave the LRU
        before any of the current span's and the read-ahead can enter the next span; at most the whole corpus."""
        assert isinstance(self.order, WindowOrder)
        per_lane = 2 * (math.ceil(self.order.span / self.order.window) + 1)
        windows = min(self.order.num_windows, self.lanes_per_rank(ranks) * per_lane)
        return windows * window_bytes

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.order.samples(positions)

    def lanes(self, positions: np.ndarray) -> np.ndarray:
        return self.order.lanes(positions)

    def fetch(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        L = self.seq_len
        if self.windows is not None:
            return {"tokens": self.windows.read(sample_ids)}
        rows = self.corpus.read([(int(i) * L, int(i) * L + L + 1) for i in sample_ids])
        return {"tokens": np.stack(rows) if rows else np.zeros((0, L + 1), dtype=np.int64)}

    def describe(self) -> dict:
        return {"seq_len": self.seq_len, "shuffle": self.order.describe()}


class PretrainLoader(ElasticLoader):
    """Batches ``{"input_ids", "labels"}`` (torch int64 ``[G/D, seq_len]``) of this rank's slice.

    ``data``: one dataset - a shard prefix URL, a dataset directory, or a list of them; or, with ``weights``,
    a list of such datasets to blend.

    ``shuffle``: ``"windows"`` (the default: local in storage; ``lanes``, ``window_bytes`` and ``span_windows``
    set it, docs/DATALOADERS.md), ``"global"`` (the exact uniform shuffle of every epoch; reads through a block
    cache of ``block_size`` blocks) or ``"none"``. ``cache_bytes``: the memory cache (None: in the windowed order,
    what this rank's lanes draw from at once; else 256 MiB). ``disk_cache``: a local directory (or a
    :class:`DiskCache`) that keeps what was read, up to ``disk_cache_bytes``, shared by the processes of a node.
    """

    def __init__(
        self,
        data: str | list,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        weights: list[float] | None = None,
        storage_options: dict | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_bytes: int | None = None,
        prefetch: int = 2,
        num_threads: int = 2,
        shuffle: str = "windows",
        lanes: int = DEFAULT_LANES,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        span_windows: int = DEFAULT_SPAN_WINDOWS,
        disk_cache: str | os.PathLike | DiskCache | None = None,
        disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES,
    ) -> None:
        check_batch(global_batch_size, dp_rank, dp_size)  # (before the sources, which plan for dp_size ranks)
        datasets = datasets_of(data, weights)
        self.io_stats = IOStats()
        if disk_cache is None or isinstance(disk_cache, DiskCache):
            disk = disk_cache
        else:
            disk = DiskCache(disk_cache, disk_cache_bytes)
        share = None if cache_bytes is None else cache_bytes // len(datasets)
        sources = [
            PretrainSource(
                open_corpus(
                    d, storage_options, block_size, share if share is not None else DEFAULT_CACHE_BYTES,
                    self.io_stats, disk,
                ),
                seq_len, seed, shuffle, lanes, window_bytes, span_windows, share, dp_size,
            )
            for d in datasets
        ]  # fmt: skip
        if shuffle == "windows" and global_batch_size % lanes and lanes % global_batch_size:
            log.warning(
                "global batch %d and %d lanes: neither divides the other, so a rank's slice of each batch moves "
                "across the lanes and draws from all of them; the cache, sized for a rank's own lanes, will read "
                "windows more than once (make the batch a multiple of the lanes, or give cache_bytes for all)",
                global_batch_size,
                lanes,
            )
        self.seq_len = seq_len
        self.disk_cache = disk
        super().__init__(sources, global_batch_size, dp_rank, dp_size, weights, seed, prefetch, num_threads)

    def _to_model_inputs(self, tensors: dict) -> dict:
        tokens = tensors["tokens"]
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
