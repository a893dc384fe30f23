"""How bytes move: a small key/value interface over local files and fsspec filesystems (memory, S3, ...).

Keys are '/'-separated paths relative to the storage root. Every object is written whole by one call
(no appends, no read-modify-write). Each storage counts the bytes it moves (`stats`), which is how read
amplification is measured, and can record every key it writes (`stats.write_log`).
"""

from __future__ import annotations

import functools
import os
import posixpath
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec

from .errors import CheckpointNotFoundError, StateError

Buffer = bytes | bytearray | memoryview


@dataclass
class IOStats:
    """Bytes and operations through one storage; `write_log` (if a list) receives every key written."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    write_log: list[str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_read(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1

    def record_write(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_written += nbytes
            self.writes += 1
            if self.write_log is not None:
                self.write_log.append(key)


def scatter_into(data: memoryview, buffers: Sequence[memoryview]) -> int:
    """Copy `data` into `buffers` back to back; returns the bytes copied."""
    pos = 0
    for b in buffers:
        if pos >= len(data):
            break
        n = min(b.nbytes, len(data) - pos)
        memoryview(b).cast("B")[:n] = data[pos : pos + n]
        pos += n
    return pos


def check_relative_key(key: str) -> str:
    """Refuse keys that would leave the storage root (defence in depth: state keys are checked earlier)."""
    norm = posixpath.normpath(key)
    if key.startswith("/") or norm == ".." or norm.startswith("../") or "\\" in key or "\x00" in key:
        raise StateError(f"storage key {key!r} escapes the checkpoint root")
    return key


class Storage(ABC):
    """A root URL and the operations ucp needs below it."""

    url: str
    stats: IOStats
    whole_object_reads = False  # True where a request costs more than the bytes it moves (object stores)
    default_io_threads = 16  # requests in flight when the caller does not say

    @abstractmethod
    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        """Write one object whole, from parts laid back to back."""

    @abstractmethod
    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        """Bytes [start, end) of an object (to its end when end is None). Missing object: FileNotFoundError."""

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Scatter-read bytes from `offset` into `buffers` back to back; returns the bytes read (less at the
        object's end). Missing object: FileNotFoundError."""
        data = self.read(key, offset, offset + sum(b.nbytes for b in buffers))
        return scatter_into(data, buffers)

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def listdir(self, key: str = "") -> list[str]:
        """Names of the children of a directory (prefix); [] when it does not exist."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object or a whole directory (prefix); absent is not an error."""

    def flush(self) -> None:
        """Make everything written so far durable (a barrier before a commit)."""

    def root_exists(self) -> bool:
        return True

    def for_writer_process(self) -> Storage | None:
        """This storage, if a copy of it in another process (unpickled there) writes the same objects; None
        where writes must stay in this process."""
        return None


class LocalStorage(Storage):
    """Plain POSIX files: vectored writes, fsync for durability, direct reads into preallocated buffers."""

    def __init__(self, root: str, *, fsync: bool = True):
        self.root = os.path.abspath(root)
        self.url = self.root
        self.fsync = fsync
        self.stats = IOStats()
        self._made_dirs: set[str] = set()
        self._unsynced_dirs: set[str] = set()  # gained an entry since the last flush
        self._dirs_lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_relative_key(key)) if key else self.root

    def _makedirs(self, directory: str) -> None:
        if directory in self._made_dirs:
            return
        os.makedirs(directory, exist_ok=True)
        # the new directories, and the existing one that gained an entry, need an fsync before a commit
        chain = [directory]
        while chain[-1] not in self._made_dirs and chain[-1].startswith(self.root + os.sep):
            chain.append(os.path.dirname(chain[-1]))
        with self._dirs_lock:
            self._made_dirs.update(chain)
            self._unsynced_dirs.update(chain)

    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        self._makedirs(directory)
        if self.fsync:
            with self._dirs_lock:
                self._unsynced_dirs.add(directory)
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(v.nbytes for v in views)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while views:  # writev may write less than asked
                done = os.writev(fd, views[:1024])
                while views and done >= views[0].nbytes:
                    done -= views[0].nbytes
                    views.pop(0)
                if done:
                    views[0] = views[0][done:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self.stats.record_write(key, total)

    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        with open(self._path(key), "rb", buffering=0) as f:
            if end is None:
                end = os.fstat(f.fileno()).st_size
            buf = bytearray(max(0, end - start))
            got = os.preadv(f.fileno(), [buf], start) if buf else 0
        self.stats.record_read(got)
        return memoryview(buf)[:got]

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        # Straight into the destination tensors: no intermediate copy.
        pending = [memoryview(b).cast("B") for b in buffers if b.nbytes]
        total = 0
        with open(self._path(key), "rb", buffering=0) as f:
            while pending:
                got = os.preadv(f.fileno(), pending[:1024], offset + total)
                if got == 0:
                    break
                total += got
                while pending and got >= pending[0].nbytes:
                    got -= pending[0].nbytes
                    pending.pop(0)
                if got:
                    pending[0] = pending[0][got:]
        self.stats.record_read(total)
        return total

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def listdir(self, key: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._path(key)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        import shutil

        path = self._path(key)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            with self._dirs_lock:
                gone = {d for d in self._made_dirs if d == path or d.startswith(path + os.sep)}
                self._made_dirs -= gone
                self._unsynced_dirs -= gone
        elif os.path.exists(path):
            os.remove(path)

    def flush(self) -> None:
        if not self.fsync:
            return
        with self._dirs_lock:
            directories, self._unsynced_dirs = self._unsynced_dirs, set()
        # A new file is durable only once its directory entry is: fsync every directory that gained an entry
        # (a file or a new directory) since the last flush.
        for directory in sorted(directories):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    def for_writer_process(self) -> Storage | None:
        # a subclass may add behaviour (a test's failure injection) that a copy elsewhere would lack
        return self if type(self) is LocalStorage else None

    def __reduce__(self) -> tuple:
        return (functools.partial(LocalStorage, fsync=self.fsync), (self.root,))


class FsspecStorage(Storage):
    """Any fsspec filesystem: memory://, s3:// (s3fs), ... One request per object write or range read."""

    whole_object_reads = True
    default_io_threads = 64  # an object store's latency is hidden by many requests (s3fs's pool is 64 connections)

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.stats = IOStats()

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_relative_key(key)}" if key else self.root

    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        self.fs.pipe_file(self._path(key), bytes(data))
        self.stats.record_write(key, len(data))

    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        data = self.fs.cat_file(self._path(key), start=start or None, end=end)
        self.stats.record_read(len(data))
        return memoryview(data)

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def listdir(self, key: str = "") -> list[str]:
        path = self._path(key)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        names.discard("")
        return sorted(names)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def root_exists(self) -> bool:
        if self.fs.protocol in ("s3", "s3a") or "s3" in (self.fs.protocol or ()):
            return True  # object stores have no directories: an empty prefix is simply empty
        return bool(self.fs.exists(self.root))

    def for_writer_process(self) -> Storage | None:
        in_memory = "memory" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        return self if type(self) is FsspecStorage and not in_memory else None

    def __reduce__(self) -> tuple:
        return (FsspecStorage, (self.fs, self.root, self.url))


def open_storage(url: str, storage_options: dict[str, Any] | None = None, *, fsync: bool = True) -> Storage:
    """A storage for a local path, file://, memory://, s3:// or any other fsspec URL.

    S3 endpoint and credentials come from `storage_options` (s3fs arguments such as endpoint_url, key,
    secret) or the standard AWS environment variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).
    """
    if not isinstance(url, str) or not url:
        raise CheckpointNotFoundError(f"a checkpoint URL must be a non-empty string, got {url!r}")
    options = dict(storage_options or {})
    protocol, _, rest = url.partition("://")
    if not rest:
        return LocalStorage(url, fsync=fsync)
    if protocol == "file":
        return LocalStorage(rest, fsync=fsync)
    if protocol in ("s3", "s3a"):
        options.setdefault("use_listings_cache", False)
        config = dict(options.pop("config_kwargs", {}) or {})
        config.setdefault("max_pool_connections", 64)  # botocore's default pool of 10 caps concurrency
        options["config_kwargs"] = config
        if "endpoint_url" not in options and os.environ.get("AWS_ENDPOINT_URL"):
            options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    fs, root = fsspec.core.url_to_fs(url, **options)
    return FsspecStorage(fs, root, url)
