"""Resumable, elastic token loaders whose state is plain JSON that a checkpoint carries.

This package imports nothing else of the project.
"""

from .blockcache import BlockCache, MemoryCache
from .corpus import Corpus, open_corpus
from .diskcache import DiskCache
from .errors import (
    BatchSizeError,
    DataLoaderError,
    IndexFormatError,
    InputFormatError,
    ManifestFormatError,
    ManifestMismatchError,
    ShardNotFoundError,
    StateError,
)
from .fetch import Fetcher, IOStats
from .indexed import IndexedDataset, IndexedDatasetWriter, parse_index
from .loader import Batch, ElasticLoader
from .manifest import Manifest, ShardInfo
from .order import SHUFFLES, EpochOrder, WindowOrder
from .pretrain import PretrainLoader
from .sft import SFTLoader
from .tokenize import ByteTokenizer, TokenIds, load_tokenizer, prepare

__all__ = [
    "SHUFFLES",
    "Batch",
    "BatchSizeError",
    "BlockCache",
    "ByteTokenizer",
    "Corpus",
    "DataLoaderError",
    "DiskCache",
    "ElasticLoader",
    "EpochOrder",
    "Fetcher",
    "IOStats",
    "IndexFormatError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "InputFormatError",
    "Manifest",
    "ManifestFormatError",
    "ManifestMismatchError",
    "MemoryCache",
    "PretrainLoader",
    "SFTLoader",
    "ShardInfo",
    "ShardNotFoundError",
    "StateError",
    "TokenIds",
    "WindowOrder",
    "load_tokenizer",
    "open_corpus",
    "parse_index",
    "prepare",
]
