"""Resumable, elastic token loaders whose state is plain JSON that a checkpoint carries.

This package imports nothing else of the project.
"""

from .blockcache import BlockCache, IOStats
from .corpus import Corpus, open_corpus
from .errors import (
    BatchSizeError,
    DataLoaderError,
    IndexFormatError,
    InputFormatError,
    ManifestMismatchError,
    ShardNotFoundError,
    StateError,
)
from .indexed import IndexedDataset, IndexedDatasetWriter, parse_index
from .loader import Batch, ElasticLoader
from .manifest import Manifest, ShardInfo
from .pretrain import PretrainLoader
from .sft import SFTLoader
from .tokenize import ByteTokenizer, load_tokenizer, prepare

__all__ = [
    "Batch",
    "BatchSizeError",
    "BlockCache",
    "ByteTokenizer",
    "Corpus",
    "DataLoaderError",
    "ElasticLoader",
    "IOStats",
    "IndexFormatError",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "InputFormatError",
    "Manifest",
    "ManifestMismatchError",
    "PretrainLoader",
    "SFTLoader",
    "ShardInfo",
    "ShardNotFoundError",
    "StateError",
    "load_tokenizer",
    "open_corpus",
    "parse_index",
    "prepare",
]
