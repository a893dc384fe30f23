"""How bytes move: a small key/value interface over local files and fsspec filesystems (memory, S3, ...).

- `base`: the interfaces, `ReadableStorage` (reads: what a load takes) and `Storage` (reads and writes: what a save
  takes), and `Capabilities`, what a store declares it can do (`storage.capabilities`, the one place to ask);
- `local`: `LocalStorage`, POSIX files (link safety, durability, reading ahead);
- `fsspec`: `FsspecStorage`, any fsspec filesystem; `s3`: what is S3's own (client options, checksums, buckets);
- `errors`: the one place where a storage library's exception becomes a ucp error;
- `urls`: `open_storage`, which store a URL names.

Layer 2 of docs/ARCHITECTURE.md: it may import layers 0 and 1, and imports only `ucp.errors`. Inside it, a module
imports only those listed above it (`tests/test_architecture.py`): no interface knows an implementation.
"""

from .base import (
    CLOCK_KEY,
    DEFAULT_IO_THREADS,
    Buffer,
    Capabilities,
    IOStats,
    ReadableStorage,
    Storage,
    check_relative_key,
    scatter_into,
    writable,
)
from .errors import service_error, storage_error
from .fsspec import FSSPEC_IO_THREADS, FsspecStorage
from .local import (
    MEMORY_FILE_SYSTEMS,
    PREFETCH_AHEAD,
    PREFETCH_GIVE_UP_CACHED,
    PREFETCH_MIN_KEYS,
    LocalStorage,
    file_system_type,
)
from .s3 import S3_ATTEMPTS, S3_CONNECT_TIMEOUT_S, S3_SINGLE_PUT_BYTES
from .urls import open_storage

__all__ = [
    "CLOCK_KEY",
    "DEFAULT_IO_THREADS",
    "FSSPEC_IO_THREADS",
    "MEMORY_FILE_SYSTEMS",
    "PREFETCH_AHEAD",
    "PREFETCH_GIVE_UP_CACHED",
    "PREFETCH_MIN_KEYS",
    "S3_ATTEMPTS",
    "S3_CONNECT_TIMEOUT_S",
    "S3_SINGLE_PUT_BYTES",
    "Buffer",
    "Capabilities",
    "FsspecStorage",
    "IOStats",
    "LocalStorage",
    "ReadableStorage",
    "Storage",
    "check_relative_key",
    "file_system_type",
    "open_storage",
    "scatter_into",
    "service_error",
    "storage_error",
    "writable",
]
