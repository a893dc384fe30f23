"""The storage interfaces: `ReadableStorage` (what a load, an inspection or a restore source needs), `Storage` (that
and the writes a save needs), and `Capabilities`, what a store declares it can do and how it is best driven.

Keys are '/'-separated paths relative to the storage root. Every object is written whole by one call (no appends,
no read-modify-write); `create_exclusive` writes one only if nothing is there yet (the commit). Each storage counts
the bytes it moves (`stats`), which is how read amplification is measured, and can record every key it writes
(`stats.write_log`). Failures other than a missing object are `StorageError`s naming the path.
"""

from __future__ import annotations

import posixpath
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import ReadOnlyStorageError, StateError

Buffer = bytes | bytearray | memoryview
SINGLE_WRITER_OPTION = "single_writer"  # ucp's own storage option (`Capabilities.exclusive_creates`), not s3fs's
CLOCK_KEY = ".ucp-clock"  # an empty object at the root, rewritten to read the store's time (Storage.clock)
DEFAULT_IO_THREADS = 16  # requests in flight where neither the caller nor the store says otherwise (a disk)


@dataclass(frozen=True)
class Capabilities:
    """What a store can do and how it is best driven, as the store declares it (`ReadableStorage.capabilities`):
    the one place where a caller (the save pipeline, the writer process, a reader, the hot tier, the benchmarks)
    asks. The defaults promise nothing beyond the interface."""

    io_threads: int = DEFAULT_IO_THREADS
    """Requests in flight when the caller does not say: 16 on a disk, two per core in memory, 64 on an object store."""

    read_threads: int | None = None
    """Reads in flight for a load when the caller does not say; None: `io_threads`. A disk's writes wait on fsyncs,
    which many in flight hide; its reads, once the kernel reads ahead, are CPU work (the kernel's copies, checksums,
    Python between them) that threads beyond the cores' share only make contend."""

    @property
    def reads_in_flight(self) -> int:
        return self.read_threads or self.io_threads

    whole_object_reads: bool = False
    """A request costs more than the bytes it moves (an object store): an object whose inner chunks are all wanted is
    read whole, in one request."""

    serial_small_reads: bool = False
    """Small objects (`workpool.SMALL_OBJECT_BYTES`) are read faster one at a time than many at once: where each
    costs CPU (Python and short system calls, which contend for the GIL), not a wait (a request's latency, a disk's
    seek), which only many in flight hide."""

    serial_small_writes: bool = False
    """As `serial_small_reads`, for writes (where no fsync or request is waited for)."""

    exclusive_creates: bool = False
    """`create_exclusive` is atomic: of several callers racing on one key exactly one succeeds. A store whose server
    may ignore the condition (S3's If-None-Match: older S3-compatible stores and some gateways drop it) checks before
    anything relies on it: `FsspecStorage` on S3 probes it before its first create, once per endpoint and bucket in a
    process (a key of its own created twice: the second must be refused), and declares what it found. Where creates
    are not exclusive, `create_exclusive` refuses (`NonExclusiveStoreError`: two saves of one step could both
    commit), unless the store was opened with the storage option `single_writer=true`: one process saves each step,
    and a create is a check, then a write."""

    writer_process: bool = False
    """A copy of the store unpickled in another process (the writer process of async saves) writes the same objects
    as this one; not so for a store in this process's memory, or one whose behaviour a copy would lack."""


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


def nothing_to_advance() -> None:
    """What `prefetching` yields where it reads nothing ahead."""


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


class ReadableStorage(ABC):
    """A root URL and the reads ucp needs below it. Every store declares its `capabilities`."""

    url: str
    stats: IOStats
    capabilities: Capabilities

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

    def mtime(self, key: str) -> float | None:
        """When the object or directory was last modified (seconds since the epoch, as the store stamps it), or
        None if unknown/absent."""
        return None

    def newest_mtime(self, key: str) -> float | None:
        """The latest modification time of the object, or of anything below the directory (prefix) `key`."""
        return self.mtime(key)

    def root_exists(self) -> bool:
        return True

    @contextmanager
    def prefetching(self, keys: Sequence[str]) -> Iterator[Callable[[], None]]:
        """A context in which the storage may read `keys` ahead of a reader that reads them one after another, in
        this order; it yields a callable the reader calls after each object it has read. Default: no reading ahead."""
        yield nothing_to_advance


class Storage(ReadableStorage):
    """A store that can be written as well as read: what every save takes."""

    @abstractmethod
    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        """Write one object whole, from parts laid back to back."""

    @abstractmethod
    def create_exclusive(self, key: str, data: bytes) -> None:
        """Write a small object whole if no object has that key, else raise FileExistsError (atomically where
        `capabilities.exclusive_creates`: of several callers racing on one key exactly one succeeds). Readers never
        see it partly written."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object or a whole directory (prefix); absent is not an error."""

    def flush(self) -> None:
        """Make everything written so far durable (a barrier before a commit)."""

    def remove_empty_dir(self, key: str) -> None:
        """Remove a directory if it is empty (object stores have no directories: nothing to do)."""

    def clock(self) -> float:
        """The store's time now, on the clock that stamps its modification times (a remote file system's or an
        object store's, not this host's): what an age read from `mtime` is measured against. It costs a write of
        a small object at the root; a store that keeps no times gives this host's clock."""
        self.write(CLOCK_KEY, [b""])
        stamp = self.mtime(CLOCK_KEY)
        return time.time() if stamp is None else stamp


def writable(storage: ReadableStorage, doing: str) -> Storage:
    """`storage` as a store that can be written; a store that can only be read (a hot tier's restore source) is a
    ReadOnlyStorageError naming it and what was to be done."""
    if isinstance(storage, Storage):
        return storage
    raise ReadOnlyStorageError(f"cannot {doing} at {storage.url}: this store ({type(storage).__name__}) is read-only")
