"""How the loaders' bytes come from storage, and what that cost: every read of a dataset goes through here.

Shard data (``.bin``) is read only as byte ranges with one ``cat_ranges`` call per batch of ranges (concurrent on
remote stores); files are never ``open()``-ed, because s3fs would then pull 50 MiB of readahead per seek. A range
of a file that was registered (its size and version known) is first looked up in the node's
:class:`~dataloaders.diskcache.DiskCache`, when one is given, and kept there once read. Index files (``.idx``,
``manifest.json``) are read whole. :class:`IOStats` counts each of these, so tests and benchmarks can check what a
loader read, and from where.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import fsspec

from .diskcache import DiskCache
from .errors import IndexFormatError, ShardNotFoundError


@dataclass
class IOStats:
    """What went to storage (``bytes_read``, ``requests``: every GET, index files included) and what did not."""

    bytes_read: int = 0  # all bytes fetched from storage: .bin ranges, .idx files and manifest.json
    requests: int = 0  # GETs (one per range or whole file)
    index_bytes: int = 0  # the part of bytes_read that is .idx files and manifest.json
    index_requests: int = 0
    metadata_requests: int = 0  # HEAD / exists / listing requests (no body)
    cache_hits: int = 0  # blocks or windows found in (or being fetched into) the memory cache
    disk_hits: int = 0  # ranges served by the node's disk cache instead of storage
    disk_bytes: int = 0
    disk_damaged: int = 0  # disk cache files found damaged (then read again from storage)
    ranges: list[tuple[str, int, int]] = field(default_factory=list)  # kept only when ``record_ranges``
    record_ranges: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, path: str, start: int, end: int, index: bool = False) -> None:
        with self._lock:
            self.bytes_read += end - start
            self.requests += 1
            if index:
                self.index_bytes += end - start
                self.index_requests += 1
            if self.record_ranges:
                self.ranges.append((path, start, end))

    def metadata(self, n: int = 1) -> None:
        with self._lock:
            self.metadata_requests += n

    def hit(self, n: int = 1) -> None:
        with self._lock:
            self.cache_hits += n

    def disk_hit(self, nbytes: int) -> None:
        with self._lock:
            self.disk_hits += 1
            self.disk_bytes += nbytes

    def damaged(self) -> None:
        with self._lock:
            self.disk_damaged += 1


def filesystem(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path within it."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path


def file_version(info: dict) -> str:
    """What changes when a file is rewritten, from an fsspec ``info`` record: the S3 ETag, else the local mtime."""
    for key in ("ETag", "etag", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""


class Fetcher:
    """Byte ranges of files, from the node's disk cache where it holds them, else from storage in one call."""

    def __init__(self, fs: fsspec.AbstractFileSystem, stats: IOStats | None = None, disk: DiskCache | None = None):
        self.fs = fs
        self.stats = stats if stats is not None else IOStats()
        self.disk = disk
        self._versions: dict[str, str] = {}  # path -> "url|size|version": what a disk-cache key names

    def register(self, path: str, size: int, version: str) -> None:
        """Let ranges of ``path`` (``size`` bytes, at ``version``) be kept in the disk cache: a key names all three,
        so a file rewritten in place is never served from an old copy."""
        self._versions[path] = f"{self.fs.unstrip_protocol(path)}|{size}|{version}"

    def read(self, requests: list[tuple[str, int, int]], cache: bool = True) -> list[bytes]:
        """The bytes of each ``(path, start, end)``; ``cache=False``: never through the disk cache."""
        out: list[bytes | None] = [None] * len(requests)
        todo: list[tuple[int, str, int, int, str | None]] = []
        for k, (path, start, end) in enumerate(requests):
            if end == start:
                out[k] = b""
                continue
            ident = self._versions.get(path) if cache and self.disk is not None else None
            key = f"{ident}|{start}-{end}" if ident is not None else None
            if key is not None and self.disk is not None:
                data = self.disk.get(key, end - start, self.stats.damaged)
                if data is not None:
                    self.stats.disk_hit(len(data))
                    out[k] = data
                    continue
            todo.append((k, path, start, end, key))
        if todo:
            try:
                datas = self.fs.cat_ranges(
                    [p for _, p, _, _, _ in todo], [s for _, _, s, _, _ in todo], [e for _, _, _, e, _ in todo],
                    on_error="return",
                )  # fmt: skip
            except FileNotFoundError as e:
                raise ShardNotFoundError(f"shard data vanished while reading: {e}") from e
            for (k, path, start, end, key), data in zip(todo, datas, strict=True):
                if isinstance(data, FileNotFoundError):
                    raise ShardNotFoundError(f"shard data vanished while reading: {path}: {data}") from data
                if isinstance(data, BaseException):
                    raise data
                if len(data) != end - start:
                    raise IndexFormatError(
                        f"{path}: short read at offset {start}: expected {end - start} bytes, got {len(data)}"
                    )
                self.stats.add(path, start, end)
                if key is not None and self.disk is not None:
                    self.disk.put(key, data)
                out[k] = data
        return out  # type: ignore[return-value] - every slot is filled above
