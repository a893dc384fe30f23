"""Exceptions raised by the data loaders; each message names the file, offset or value at fault."""

from __future__ import annotations


class DataLoaderError(Exception):
    """Base class of every error raised by ``dataloaders``."""


class IndexFormatError(DataLoaderError):
    """A ``.idx`` (or its ``.bin``) is damaged, truncated or not in the MMIDIDX layout."""


class ManifestFormatError(DataLoaderError):
    """A dataset's ``manifest.json`` is damaged, cut short or not one ``prepare`` writes."""


class ShardNotFoundError(DataLoaderError):
    """A shard named by a manifest or a URL does not exist."""


class ManifestMismatchError(DataLoaderError):
    """A saved loader state was made for another dataset (or shards changed since ``prepare``)."""


class BatchSizeError(DataLoaderError):
    """The global batch is not divisible by the data-parallel size, or another size is invalid."""


class StateError(DataLoaderError):
    """A loader state dict is malformed or of an unknown version."""


class InputFormatError(DataLoaderError):
    """An input record (text, JSONL, chat messages) cannot be tokenized."""
