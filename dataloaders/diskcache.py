"""A bounded cache of byte ranges of shard files on a node's local disk, shared by the processes of that node.

Object stores charge per request and per byte, and a job reads the same windows again in later epochs, after a
restart, and from other ranks of the node. This cache keeps what was read as one file per range, named by a hash
of its key (the file's URL, size and version, and the range), so every process that opens the same directory
shares it without talking to the others:

- **Atomic creation.** A file is written under ``tmp/`` and renamed into place: a reader sees a whole file or
  none; files are never changed after that, so there is no torn read. Two processes caching the same range each
  rename a whole copy; either one wins.
- **Damage is detected.** Each file starts with a header holding its key, its length and the CRC-32 of its
  bytes; a file that fails any check (a crash without fsync, a full disk, a flipped bit) is removed and the range
  read again from storage. A key that differs (a hash collision) is a miss.
- **Bounded.** The bytes held are counted in a shared ``size`` file under an exclusive ``flock``: a put adds what
  it grew the directory by; a count not there yet (a new cache), and the count after a damaged file was removed,
  is a scan of the directory. A put that takes it over the bound evicts the least recently used files (a hit
  refreshes a file's mtime) down to 90% of it, recounting the directory as it goes, so the count cannot drift. A
  file evicted while another process reads it stays readable to that process (POSIX unlink); one evicted just
  before is a miss.
- **Never the reason a read fails.** A write that fails (no space, no permission) is logged and skipped.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .errors import DataLoaderError

log = logging.getLogger(__name__)

MAGIC = b"UCPDLC01"
_HEADER = struct.Struct("<8sIQI")  # magic, crc32 of the data, data length, key length
LOW_WATER = 0.9  # an eviction leaves the cache at this fraction of its bound
STALE_TMP_S = 3600.0  # a tmp/ file this old belongs to a process that died while writing it


class DiskCache:
    """Byte ranges on local disk under ``directory``, at most ``capacity_bytes`` of them (file headers included)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise DataLoaderError(f"disk cache bound must be positive, got {capacity_bytes} bytes")
        self.directory = os.path.abspath(os.fspath(directory))
        self.capacity_bytes = int(capacity_bytes)
        self._tmp = os.path.join(self.directory, "tmp")
        self._size_path = os.path.join(self.directory, "size")
        self._lock_path = os.path.join(self.directory, "lock")
        try:
            os.makedirs(self._tmp, exist_ok=True)
            with open(self._lock_path, "a"):
                pass
        except OSError as e:
            raise DataLoaderError(f"disk cache directory {self.directory} cannot be used: {e}") from e
        self._thread_lock = threading.Lock()  # flock is per open file: threads of one process take turns first

    def _path(self, key: str) -> str:
        h = hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.directory, h[:2], h)

    def get(self, key: str, length: int, on_damaged: Callable[[], None] | None = None) -> bytes | None:
        """The bytes cached under ``key`` if a whole, undamaged copy of ``length`` bytes is there, else None
        (``on_damaged`` is called when a damaged copy was found and removed)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("disk cache: cannot read %s (%s); reading from storage", path, e)
            return None
        problem = None
        kb = key.encode()
        if len(raw) < _HEADER.size:
            problem = f"{len(raw)} bytes, shorter than its header"
        else:
            magic, crc, n, nkey = _HEADER.unpack_from(raw)
            if magic != MAGIC:
                problem = f"magic {magic!r}"
            elif len(raw) != _HEADER.size + nkey + n:
                problem = f"{len(raw)} bytes, its header says {_HEADER.size + nkey + n}"
            elif raw[_HEADER.size : _HEADER.size + nkey] != kb:
                return None  # another key with the same hash: not ours, not damaged
            elif n != length:
                problem = f"{n} bytes of data where the range has {length}"
            elif zlib.crc32(memoryview(raw)[_HEADER.size + nkey :]) != crc:
                problem = "CRC-32 mismatch"
        if problem is not None:
            log.warning("disk cache: %s is damaged (%s): removed, reading the range from storage", path, problem)
            if on_damaged is not None:
                on_damaged()
            if self._remove(path):
                self._account(None, path)  # (what the count held of it is unknown: its header may be the damage)
            return None
        try:
            os.utime(path)  # recently used: the last to be evicted
        except OSError:
            pass  # evicted meanwhile: the bytes in hand are still whole
        return raw[_HEADER.size + len(kb) :]

    def put(self, key: str, data: bytes) -> None:
        """Keep ``data`` under ``key``, evicting the least recently used files if the bound is passed."""
        path = self._path(key)
        kb = key.encode()
        tmp = os.path.join(self._tmp, f"{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, zlib.crc32(data), len(data), len(kb)))
                f.write(kb)
                f.write(data)
            try:
                replaced = os.stat(path).st_size  # (another process cached the same range first: no bytes added)
            except FileNotFoundError:
                replaced = 0
            os.replace(tmp, path)
        except OSError as e:
            log.warning("disk cache: cannot write %s (%s); going on without caching it", path, e)
            self._remove(tmp)
            return
        self._account(_HEADER.size + len(kb) + len(data) - replaced, path)

    def _account(self, delta: int | None, path: str) -> None:
        """Add ``delta`` bytes (what ``path`` changed the directory by, done already) to the shared count, evicting
        if it passes the bound; ``None``, or a count not there yet: a scan of the directory, which has the change."""
        try:
            with self._locked():
                total = self._read_size()
                total = self._scan_total() if total is None or delta is None else max(0, total + delta)
                if total > self.capacity_bytes:
                    total = self._evict()
                self._write_size(total)
        except OSError as e:
            log.warning("disk cache: cannot account for %s in %s (%s)", path, self.directory, e)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_size(self) -> int | None:
        """The shared count, or None where there is none (a new cache) or it is damaged."""
        try:
            with open(self._size_path) as f:
                return int(f.read().strip() or 0)
        except (FileNotFoundError, ValueError):
            return None

    def _write_size(self, total: int) -> None:
        tmp = f"{self._size_path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(total))
        os.replace(tmp, self._size_path)

    def _files(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every cached file."""
        out = []
        with os.scandir(self.directory) as top:
            for d in top:
                if len(d.name) != 2 or not d.is_dir():
                    continue
                with os.scandir(d.path) as inner:
                    for f in inner:
                        try:
                            st = f.stat()
                        except FileNotFoundError:
                            continue
                        out.append((st.st_mtime, st.st_size, f.path))
        return out

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _evict(self) -> int:
        """Remove the least recently used files until the cache holds at most LOW_WATER of its bound; returns what
        is left. Runs under the lock, so one process evicts at a time."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        target = int(self.capacity_bytes * LOW_WATER)
        removed = 0
        for _, size, path in files:
            if total <= target:
                break
            if self._remove(path):
                total -= size
                removed += 1
        self._remove_stale_tmp()
        log.debug("disk cache %s: evicted %d files, %d bytes left", self.directory, removed, total)
        return total

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        with os.scandir(self._tmp) as it:
            for f in it:
                try:
                    if now - f.stat().st_mtime > STALE_TMP_S:
                        os.unlink(f.path)
                except FileNotFoundError:
                    continue

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("disk cache: cannot remove %s (%s)", path, e)
            return False

    @property
    def size_bytes(self) -> int:
        """The bytes the cache holds now (a scan of the directory)."""
        return self._scan_total()
