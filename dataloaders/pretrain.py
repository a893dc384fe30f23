"""The pretraining loader: fixed-length samples over documents concatenated in shard order (Megatron-style).

Sample ``i`` is tokens ``[i*L, i*L + L + 1)`` of the concatenated stream: ``L`` inputs and the ``L`` labels
shifted by one, so consecutive samples share one boundary token and a sample may span documents and shards.
"""

from __future__ import annotations

import numpy as np

from .blockcache import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_BYTES, IOStats
from .corpus import Corpus, open_corpus
from .errors import DataLoaderError
from .loader import ElasticLoader
from .order import EpochOrder


class PretrainSource:
    kind = "pretrain"

    def __init__(self, corpus: Corpus, seq_len: int, seed: int = 0, shuffle: bool = True) -> None:
        if seq_len <= 0:
            raise DataLoaderError(f"seq_len must be positive, got {seq_len}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.manifest_hash = corpus.manifest.hash
        self.num_samples = (corpus.num_tokens - 1) // seq_len
        if self.num_samples <= 0:
            raise DataLoaderError(
                f"dataset {self.manifest_hash} has {corpus.num_tokens} tokens: too few for one sample of "
                f"{seq_len} + 1 tokens"
            )
        self.order = EpochOrder(self.num_samples, seed, self.manifest_hash, shuffle)

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.order.samples(positions)

    def fetch(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        L = self.seq_len
        rows = self.corpus.read([(int(i) * L, int(i) * L + L + 1) for i in sample_ids])
        return {"tokens": np.stack(rows) if rows else np.zeros((0, L + 1), dtype=np.int64)}

    def describe(self) -> dict:
        return {"seq_len": self.seq_len}


class PretrainLoader(ElasticLoader):
    """Batches ``{"input_ids", "labels"}`` (torch int64 ``[G/D, seq_len]``) of this rank's slice.

    ``data``: one dataset - a shard prefix URL, a dataset directory, or a list of them; or, with ``weights``,
    a list of such datasets to blend.
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
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        prefetch: int = 2,
        num_threads: int = 2,
        shuffle: bool = True,
    ) -> None:
        datasets = list(data) if weights is not None else [data]
        self.io_stats = IOStats()
        sources = [
            PretrainSource(
                open_corpus(d, storage_options, block_size, cache_bytes // len(datasets), self.io_stats),
                seq_len,
                seed,
                shuffle,
            )
            for d in datasets
        ]
        self.seq_len = seq_len
        super().__init__(sources, global_batch_size, dp_rank, dp_size, weights, seed, prefetch, num_threads)

    def _to_model_inputs(self, tensors: dict) -> dict:
        tokens = tensors["tokens"]
        return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
