"""How bytes move: a small key/value interface over local files and fsspec filesystems (memory, S3, ...).

Keys are '/'-separated paths relative to the storage root. Every object is written whole by one call
(no appends, no read-modify-write); `create_exclusive` writes one only if nothing is there yet (the commit).
Each storage counts the bytes it moves (`stats`), which is how read amplification is measured, and can record
every key it writes (`stats.write_log`).

Failures other than a missing object are `StorageError`s naming the path: no space, no permission, an object
store that refuses or cannot be reached. Local storage never follows a symbolic link below its root (neither a
file's nor a directory's) and reads only regular files, so a link or a FIFO planted in a checkpoint cannot redirect
a write, a read or a removal, nor hang a read.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import errno
import functools
import logging
import os
import posixpath
import stat
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import crc32c
import fsspec

from .errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    NotAFileError,
    StateError,
    StorageAuthError,
    StorageError,
    StorageUnreachableError,
    UcpError,
)

Buffer = bytes | bytearray | memoryview
CLOCK_KEY = ".ucp-clock"  # an empty object at the root, rewritten to read the store's time (Storage.clock)
log = logging.getLogger("ucp")


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
    def create_exclusive(self, key: str, data: bytes) -> None:
        """Write a small object whole if and only if no object has that key: of several callers racing on one
        key exactly one succeeds, the others get FileExistsError. Readers never see it partly written."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def mtime(self, key: str) -> float | None:
        """When the object or directory was last modified (seconds since the epoch, as the store stamps it), or
        None if unknown/absent."""
        return None

    def newest_mtime(self, key: str) -> float | None:
        """The latest modification time of the object, or of anything below the directory (prefix) `key`."""
        return self.mtime(key)

    def clock(self) -> float:
        """The store's time now, on the clock that stamps its modification times (a remote file system's or an
        object store's, not this host's): what an age read from `mtime` is measured against. It costs a write of
        a small object at the root; a store that keeps no times gives this host's clock."""
        self.write(CLOCK_KEY, [b""])
        stamp = self.mtime(CLOCK_KEY)
        return time.time() if stamp is None else stamp

    @abstractmethod
    def listdir(self, key: str = "") -> list[str]:
        """Names of the children of a directory (prefix); [] when it does not exist."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object or a whole directory (prefix); absent is not an error."""

    def flush(self) -> None:
        """Make everything written so far durable (a barrier before a commit)."""

    @contextmanager
    def prefetching(self, keys: Sequence[str]) -> Iterator[Callable[[], None]]:
        """A context in which the storage may read `keys` ahead of a reader that reads them one after another, in
        this order; it yields a callable the reader calls after each object it has read. Default: no reading ahead."""
        yield _nothing

    def remove_empty_dir(self, key: str) -> None:
        """Remove a directory if it is empty (object stores have no directories: nothing to do)."""

    def root_exists(self) -> bool:
        return True

    def for_writer_process(self) -> Storage | None:
        """This storage, if a copy of it in another process (unpickled there) writes the same objects; None
        where writes must stay in this process."""
        return None

    def serial_small_objects(self, writing: bool) -> bool:
        """Whether small objects (workpool.SMALL_OBJECT_BYTES) go faster one at a time than many at once: where
        each costs CPU (Python and short system calls, which contend for the GIL), not a wait (a request's
        latency, an fsync), which only many in flight hide."""
        return False


def _nothing() -> None:
    pass


_PARALLEL_DIR_SYNCS = 32  # a flush with fewer directories syncs them in the calling thread

# How many objects LocalStorage.prefetching asks for ahead of its reader: enough to keep a disk busy, few enough
# (small objects: 256 of at most SMALL_OBJECT_BYTES, 64 MiB) that the page cache keeps them until they are read.
PREFETCH_AHEAD = 256
# ... after how many objects in a row that it finds in the page cache already it looks at only one in so many (a
# warm checkpoint: its Python would only contend with the reader's for the GIL) ...
PREFETCH_GIVE_UP_CACHED = 64
# ... and how many objects a reader must have for it to start a thread at all (a load of one tensor has one).
PREFETCH_MIN_KEYS = 16


def _in_page_cache(fd: int) -> bool:
    """Whether the start of a file is in the page cache (a read that must not wait: RWF_NOWAIT, Linux 4.14+); False
    where that cannot be told."""
    if not hasattr(os, "RWF_NOWAIT"):
        return False
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
    except OSError:
        return False  # EAGAIN: not in memory (or the file system cannot tell)
    return True


MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def file_system_type(path: str) -> str | None:
    """The type of the file system that holds `path` (or would hold it: its nearest existing parent), from the
    longest mount point above it in /proc/self/mounts; None where that is unknown (not Linux)."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for mount_point, fs_type in mounts:
        mount_point = mount_point.replace("\\040", " ")
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= best[0]):
            best = (len(mount_point), fs_type)
    return best[1] if best else None


class LocalStorage(Storage):
    """Plain POSIX files: vectored writes, fsync for durability, direct reads into preallocated buffers."""

    def __init__(self, root: str, *, fsync: bool = True):
        self.root = os.path.abspath(root)
        self.url = self.root
        self.fsync = fsync
        self.in_memory = file_system_type(self.root) in MEMORY_FILE_SYSTEMS
        if self.in_memory:
            # In memory every write and read is a copy by a CPU: threads beyond two per core only contend (for the
            # GIL and the cores). Measured on 2 cores, 1 GiB to tmpfs: 4 threads save in 0.33-0.43 s, 16 in 0.55-0.63.
            self.default_io_threads = min(Storage.default_io_threads, 2 * (os.cpu_count() or 1))
        self.stats = IOStats()
        self._made_dirs: set[str] = set()
        self._unsynced_dirs: set[str] = set()  # gained an entry since the last flush
        self._dirs_lock = threading.Lock()
        self._real_root: str | None = None  # the root with its own links resolved (_check_opened_below_root)

    def _path(self, key: str) -> str:
        # normalised, so that the kernel never resolves a ".." (after a link, it would lead elsewhere than it reads)
        return os.path.join(self.root, posixpath.normpath(check_relative_key(key))) if key else self.root

    def _refuse_links_below_root(self, path: str) -> None:
        """Refuse, naming it, a symbolic link below the root on the way to `path` (`path` included)."""
        names = os.path.relpath(path, self.root).split(os.sep)
        if names == ["."]:
            return
        current = self.root
        for name in names:
            current = os.path.join(current, name)
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    raise NotAFileError(f"{current} is a symbolic link: ucp does not follow links inside a checkpoint")
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing below it either

    def _check_opened_below_root(self, fd: int, path: str) -> None:
        """Refuse a file or directory opened through a symbolic link below the root (O_NOFOLLOW guards a file's last
        name only): the path the kernel opened must be the one asked for. One readlink (~1 us) per open."""
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return  # no /proc (not Linux): the final name is still never a link
        if self._real_root is None or not opened.startswith(self._real_root + os.sep):
            self._real_root = os.path.realpath(self.root)  # (the root itself may be a link: its caller named it)
        wanted = self._real_root + path[len(self.root) :]
        if opened not in (wanted, wanted + " (deleted)"):
            self._refuse_links_below_root(path)  # names the link where it can still be seen
            raise StorageError(f"{path} was moved or replaced while it was opened (it is now {opened})")

    def _makedirs(self, directory: str) -> None:
        """Create `directory` and its missing parents; below the root, refuse any that is a symbolic link (a
        save must never write outside its root) or not a directory."""
        if directory in self._made_dirs:
            return
        chain = [directory]  # the directory and its parents below the root, deepest first
        while chain[-1].startswith(self.root + os.sep) and os.path.dirname(chain[-1]) not in self._made_dirs:
            chain.append(os.path.dirname(chain[-1]))
        if not chain[-1].startswith(self.root + os.sep):
            chain.pop()  # the root itself (it may be a link: the caller named it)
            self._make_root()
        for path in reversed(chain):
            try:
                os.mkdir(path)
            except FileExistsError:
                mode = os.lstat(path).st_mode
                if stat.S_ISLNK(mode):
                    raise StorageError(
                        f"{path} is a symbolic link: ucp does not follow links inside a checkpoint root"
                    ) from None
                if not stat.S_ISDIR(mode):
                    raise StorageError(f"{path} is not a directory") from None
        # the new directories, and the existing one that gained an entry, need an fsync before a commit
        with self._dirs_lock:
            self._made_dirs.update(chain)
            self._unsynced_dirs.update(chain)
            self._unsynced_dirs.add(os.path.dirname(chain[-1]) if chain else directory)

    def _make_root(self) -> None:
        """Create the root and its missing parents; each one made is durable only once its parent's entry is."""
        missing = []
        path = self.root
        while not os.path.isdir(path) and os.path.dirname(path) != path:
            missing.append(path)
            path = os.path.dirname(path)
        try:
            os.makedirs(self.root, exist_ok=True)
        except FileExistsError:
            raise StorageError(f"{self.root} is not a directory: a checkpoint root must be one") from None
        with self._dirs_lock:
            self._made_dirs.add(self.root)
            self._unsynced_dirs.update(os.path.dirname(made) for made in missing)

    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        path = self._path(key)
        try:
            total = self._write_file(path, parts, os.O_TRUNC)
        except UcpError:
            raise
        except OSError as e:
            raise StorageError(f"cannot write {path}: {e.strerror or e}") from e
        self.stats.record_write(key, total)

    def _write_file(self, path: str, parts: Sequence[Buffer], flags: int) -> int:
        directory = os.path.dirname(path)
        self._makedirs(directory)
        if self.fsync:
            with self._dirs_lock:
                self._unsynced_dirs.add(directory)
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(v.nbytes for v in views)
        open_flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | flags
        try:
            fd = os.open(path, open_flags, 0o644)
        except FileNotFoundError:  # another process removed a directory this one made earlier: make it again
            with self._dirs_lock:
                self._made_dirs.clear()
            self._makedirs(directory)
            fd = os.open(path, open_flags, 0o644)
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
        return total

    def create_exclusive(self, key: str, data: bytes) -> None:
        """Write a temporary file beside the key, make it durable, then hard-link it to the key: link fails if
        the key exists, and the object appears whole or not at all. (A file system without hard links gets an
        O_EXCL create instead, which a crash can leave torn: readers take a torn marker for no commit.)"""
        path = self._path(key)
        temp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"
        try:
            self._write_file(temp, [data], os.O_EXCL)
            try:
                os.link(temp, path, follow_symlinks=False)
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS):
                    raise
                self._write_file(path, [data], os.O_EXCL)
            finally:
                os.unlink(temp)
            self._fsync_dir(os.path.dirname(path))
        except (FileExistsError, UcpError):
            raise
        except OSError as e:
            raise StorageError(f"cannot create {path}: {e.strerror or e}") from e
        self.stats.record_write(key, len(data))

    def _open_regular(self, key: str) -> tuple[int, int]:
        """An fd of the object (never through a final symbolic link, never blocking on a FIFO) and its size."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(errno.ENOENT, "no such object", path) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NotAFileError(
                    f"{path} is a symbolic link: ucp does not follow links inside a checkpoint"
                ) from None
            raise StorageError(f"cannot read {path}: {e.strerror or e}") from e
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise NotAFileError(f"{path} is not a regular file")
            self._check_opened_below_root(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd, info.st_size

    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        fd, size = self._open_regular(key)
        try:
            end = size if end is None else min(end, size)
            buf = bytearray(max(0, end - start))
            got = os.preadv(fd, [buf], start) if buf else 0
        except OSError as e:
            raise StorageError(f"cannot read {self._path(key)}: {e.strerror or e}") from e
        finally:
            os.close(fd)
        self.stats.record_read(got)
        return memoryview(buf)[:got]

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        # Straight into the destination tensors: no intermediate copy.
        pending = [memoryview(b).cast("B") for b in buffers if b.nbytes]
        total = 0
        fd, _ = self._open_regular(key)
        try:
            while pending:
                got = os.preadv(fd, pending[:1024], offset + total)
                if got == 0:
                    break
                total += got
                while pending and got >= pending[0].nbytes:
                    got -= pending[0].nbytes
                    pending.pop(0)
                if got:
                    pending[0] = pending[0][got:]
        except OSError as e:
            raise StorageError(f"cannot read {self._path(key)}: {e.strerror or e}") from e
        finally:
            os.close(fd)
        self.stats.record_read(total)
        return total

    def exists(self, key: str) -> bool:
        return os.path.lexists(self._path(key))

    def mtime(self, key: str) -> float | None:
        try:
            return os.lstat(self._path(key)).st_mtime
        except OSError:
            return None

    def newest_mtime(self, key: str) -> float | None:
        newest = self.mtime(key)
        for directory, subdirs, files in os.walk(self._path(key)):  # (never into a linked directory)
            for name in (*subdirs, *files):
                try:
                    stamp = os.lstat(os.path.join(directory, name)).st_mtime
                except OSError:
                    continue  # removed meanwhile
                newest = stamp if newest is None else max(newest, stamp)
        return newest

    @contextmanager
    def _directory(self, path: str) -> Iterator[int]:
        """A descriptor of the directory `path` (the root or below it), checked to be reached through no link below
        the root: what is listed or removed through it is below the root, whatever is renamed meanwhile."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._check_opened_below_root(fd, path)
            yield fd
        finally:
            os.close(fd)

    def listdir(self, key: str = "") -> list[str]:
        path = self._path(key)
        try:
            with self._directory(path) as fd:
                return sorted(os.listdir(fd))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        import shutil

        path = self._path(key)
        if path == self.root:
            raise StateError(f"{path}: ucp never deletes the root of its storage")
        name = os.path.basename(path)
        try:
            with self._directory(os.path.dirname(path)) as parent:
                # (a link itself is removed, never what it points to; rmtree with dir_fd never follows one below)
                if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=parent)
                    self._forget_dirs(path)
                else:
                    os.unlink(name, dir_fd=parent)
        except (FileNotFoundError, NotADirectoryError):
            pass  # (absent, or removed meanwhile: not an error)
        except OSError as e:
            raise StorageError(f"cannot delete {path}: {e.strerror or e}") from e

    def remove_empty_dir(self, key: str) -> None:
        path = self._path(key)
        if not key:  # the root itself (named by its caller, perhaps through a link of theirs)
            with contextlib.suppress(OSError):
                os.rmdir(self.root)
            return
        try:
            with self._directory(os.path.dirname(path)) as parent:
                os.rmdir(os.path.basename(path), dir_fd=parent)
        except OSError:
            return  # not empty (a save started there meanwhile), or already gone
        self._forget_dirs(path)

    def _forget_dirs(self, path: str) -> None:
        """Drop `path` and what lies below it from the directories known to exist."""
        with self._dirs_lock:
            gone = {d for d in self._made_dirs if d == path or d.startswith(path + os.sep)}
            self._made_dirs -= gone
            self._unsynced_dirs -= gone

    def flush(self) -> None:
        with self._dirs_lock:
            directories, self._unsynced_dirs = self._unsynced_dirs, set()
        if not self.fsync or self.in_memory:
            return  # (a memory file system's fsync does nothing: its directories are as durable as they get)

        # A new file is durable only once its directory entry is: fsync every directory that gained an entry
        # (a file or a new directory) since the last flush. Many at once, as the files' own fsyncs are: a save
        # of 20,000 small atoms has 20,000 directories, ~1.4-1.9 s of fsyncs one after another on a disk.
        def sync(some: list[str]) -> None:
            for directory in some:
                try:
                    self._fsync_dir(directory)
                except FileNotFoundError:
                    pass  # removed since (a failed attempt's): nothing left to make durable

        try:
            if len(directories) < _PARALLEL_DIR_SYNCS:
                sync(list(directories))
            else:  # one slice per thread: a future per directory cost more Python than the fsyncs on a fast disk
                threads = self.default_io_threads
                ordered = list(directories)
                with cf.ThreadPoolExecutor(threads, thread_name_prefix="ucp-dirsync") as pool:
                    list(pool.map(sync, (ordered[i::threads] for i in range(threads))))
        except OSError as e:
            raise StorageError(f"cannot make {self.root} durable (fsync): {e.strerror or e}") from e

    @contextmanager
    def prefetching(self, keys: Sequence[str]) -> Iterator[Callable[[], None]]:
        # Small objects read one after another from a disk each wait for it in turn (20,000 atoms of 1-64 KiB, cold:
        # 3.2 s). A thread of its own asks the kernel for the next ones (posix_fadvise WILLNEED: reads queued, nothing
        # copied, the GIL released), so that the disk serves many at once (2.1 s). In memory there is nothing to wait
        # for; where the objects turn out to be in the page cache already, the thread stops, as its Python would only
        # contend with the reader's for the GIL (a warm load of those atoms: 1.09 s with it, 1.12 s without).
        if self.in_memory or len(keys) < PREFETCH_MIN_KEYS or not hasattr(os, "posix_fadvise"):
            yield _nothing
            return
        read = 0  # objects the reader has read (only it writes this; the thread reads it)
        stop = threading.Event()

        def advance() -> None:
            nonlocal read
            read += 1

        def read_ahead() -> None:
            cached_run = 0
            for i, key in enumerate(keys):
                while i >= read + PREFETCH_AHEAD and not stop.is_set():
                    # (a poll, no wake-up per object: the reader takes ~50 us an object; 10 ms through a warm stretch)
                    time.sleep(0.001 if cached_run < PREFETCH_GIVE_UP_CACHED else 0.01)
                if stop.is_set():
                    return
                if cached_run >= PREFETCH_GIVE_UP_CACHED and i % PREFETCH_GIVE_UP_CACHED:
                    continue  # a warm stretch: only every so many objects is looked at, in case it ends
                try:
                    fd = os.open(
                        self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
                    )
                except (OSError, UcpError):
                    continue  # (a hint only: the read itself reports what is wrong with the object)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        continue  # (a device or a FIFO: nothing to ask for; the read refuses it)
                    if _in_page_cache(fd):
                        cached_run += 1
                    else:
                        cached_run = 0
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
                finally:
                    os.close(fd)

        thread = threading.Thread(target=read_ahead, name="ucp-prefetch", daemon=True)
        try:
            thread.start()
            started = True
        except RuntimeError:  # no thread to be had (a process at its limit): read without it
            started = False
        if not started:  # (yielded outside the handler, so that the reader's errors do not chain to it)
            yield _nothing
            return
        try:
            yield advance
        finally:
            stop.set()
            thread.join()

    def _fsync_dir(self, directory: str) -> None:
        if not self.fsync:
            return
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    def serial_small_objects(self, writing: bool) -> bool:
        # A small write waits for its fsync (~1 ms on a disk): many in flight hide it. Without one it is CPU only, as
        # is a small read once `prefetching` has asked for it (20,000 small atoms from a cold disk: 3.2 s one at a
        # time, 4.2 s at 16 threads, 2.5 s at 2, 2.1 s one at a time with the read-ahead; warm, 1.1 s against 1.6 s).
        return not writing or self.in_memory or not self.fsync

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

    def _error(self, doing: str, key: str, e: BaseException) -> StorageError:
        return storage_error(f"cannot {doing} {self.url.rstrip('/')}/{key}", e, self.fs)

    @property
    def _protocols(self) -> tuple[str, ...]:
        return self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)

    @property
    def exclusive_creates(self) -> bool:
        """Whether `create_exclusive` is atomic here: S3's conditional put (If-None-Match: *), which AWS S3 and
        moto honour, and fsspec's memory and local file systems. Elsewhere it is a check, then a write."""
        return bool({"s3", "s3a", "memory", "file", "local"} & set(self._protocols))

    def _put_checksum(self, data: bytes) -> dict[str, str]:
        """On S3, the object's CRC-32C as the put's checksum (a C pass at ~10 GB/s with the GIL released): S3
        checks the upload against it and keeps it (moto keeps it unchecked), and botocore computes none of its own
        (by default a CRC-32 of every byte, in zlib). Objects s3fs uploads in parts keep botocore's part checksums."""
        if not {"s3", "s3a"} & set(self._protocols) or len(data) >= S3_SINGLE_PUT_BYTES:
            return {}
        value = base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()
        return {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": value}  # (the algorithm too, or it is not kept)

    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        try:
            self.fs.pipe_file(self._path(key), bytes(data), **self._put_checksum(data))
        except UcpError:
            raise
        except FileNotFoundError as e:  # a write creates any key: what is missing is the bucket
            raise BucketNotFoundError(
                f"cannot write {self.url.rstrip('/')}/{key}: the bucket does not exist; create it "
                "first (ucp never creates buckets)"
            ) from e
        except Exception as e:
            raise self._error("write", key, e) from e
        self.stats.record_write(key, len(data))

    def create_exclusive(self, key: str, data: bytes) -> None:
        if not self.exclusive_creates:
            log.warning("%s cannot create objects exclusively: ucp assumes a single saver per step", self.url)
            if self.exists(key):
                raise FileExistsError(errno.EEXIST, "object exists", self._path(key))
        try:
            self.fs.pipe_file(self._path(key), bytes(data), mode="create", **self._put_checksum(data))
        except FileExistsError:
            raise
        except Exception as e:
            # (s3fs raises FileExistsError where the store names the condition; one that answers a bare 412 is
            # told apart by the response botocore parsed, never by the message, which may hold a key such as
            # step_00000412)
            code, status = service_error(e)
            if code == "PreconditionFailed" or status == 412:
                raise FileExistsError(errno.EEXIST, "object exists", self._path(key)) from e
            raise self._error("create", key, e) from e
        self.stats.record_write(key, len(data))

    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        try:
            data = self.fs.cat_file(self._path(key), start=start or None, end=end)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise self._error("read", key, e) from e
        self.stats.record_read(len(data))
        return memoryview(data)

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.exists(self._path(key)))
        except Exception as e:
            raise self._error("look up", key, e) from e

    def mtime(self, key: str) -> float | None:
        try:
            info = self.fs.info(self._path(key))
        except Exception:  # noqa: BLE001 -- absent or unknown: the caller decides
            return None
        return _stamp(info)

    def newest_mtime(self, key: str) -> float | None:
        try:
            found = self.fs.find(self._path(key), detail=True)
        except Exception:  # noqa: BLE001 -- absent or unknown: the caller decides
            found = {}
        stamps = [s for s in map(_stamp, found.values()) if s is not None]
        return max(stamps) if stamps else self.mtime(key)

    def listdir(self, key: str = "") -> list[str]:
        path = self._path(key)
        try:
            entries = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as e:
            raise self._error("list", key or "(root)", e) from e
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        names.discard("")
        return sorted(names)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error("delete", key, e) from e

    def root_exists(self) -> bool:
        if {"s3", "s3a"} & set(self._protocols):
            # Object stores have no directories: an empty prefix is simply empty. But its bucket must exist.
            bucket = self.root.split("/", 1)[0]
            try:
                self.fs.call_s3("head_bucket", Bucket=bucket)  # (exists() would take a refused key for no bucket)
            except FileNotFoundError:
                raise BucketNotFoundError(
                    f"no ucp checkpoint at {self.url}: the bucket {bucket!r} does not exist; "
                    "create it first (ucp never creates buckets)"
                ) from None
            except Exception as e:
                raise storage_error(f"cannot look up {self.url}", e, self.fs) from e
            return True
        try:
            return bool(self.fs.exists(self.root))
        except Exception as e:
            raise storage_error(f"cannot look up {self.url}", e, self.fs) from e

    def for_writer_process(self) -> Storage | None:
        return self if type(self) is FsspecStorage and "memory" not in self._protocols else None

    def __reduce__(self) -> tuple:
        return (FsspecStorage, (self.fs, self.root, self.url))


def _stamp(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec `info` entry (S3's LastModified, a file system's mtime), if any."""
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
    if stamp is None:
        return None
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


# What the exceptions of botocore, aiobotocore, aiohttp, s3fs and the OS mean, by name (none of them is imported
# here: a local checkpoint never loads an S3 client).
_AUTH = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "ProfileNotFound",
}
_UNREACHABLE = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ProxyConnectionError",
    "ConnectionRefusedError",
}
_CREDENTIALS_HINT = (
    "give them as -o key=... -o secret=... (storage_options), in AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or as an AWS profile (-o profile=NAME)"
)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return out


def service_error(e: BaseException) -> tuple[str | None, int | None]:
    """The error code and HTTP status that an object store answered with, as botocore parsed them (the
    `response` of a ClientError anywhere in `e`'s chain; s3fs keeps it as the cause of what it raises), or
    (None, None) when no answer came back."""
    for exc in _chain(e):
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = error.get("Code") if isinstance(error, dict) else None
            return (str(code) if code is not None else None), (status if isinstance(status, int) else None)
    return None, None


def storage_error(what: str, e: BaseException, fs: Any = None) -> StorageError:
    """The one place where a storage library's exception becomes a ucp error: the kind of failure (credentials,
    an unreachable endpoint, a missing bucket, anything else), `what` was being done, the cause in one line; the
    original is kept as `__cause__` by the caller's `raise ... from e`."""
    endpoint = getattr(getattr(fs, "client_kwargs", None), "get", lambda _k: None)("endpoint_url") or getattr(
        fs, "endpoint_url", None
    )
    where = f" ({endpoint})" if endpoint else ""
    cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    code, _ = service_error(e)
    names = {type(exc).__name__ for exc in _chain(e)} | ({code} if code else set())
    if names & _AUTH or any(isinstance(exc, PermissionError) for exc in _chain(e)):
        return StorageAuthError(
            f"{what}: the store{where} refused the credentials, or found none ({cause}); {_CREDENTIALS_HINT}"
        )
    if names & _UNREACHABLE or any(isinstance(exc, (ConnectionRefusedError, TimeoutError)) for exc in _chain(e)):
        return StorageUnreachableError(
            f"{what}: the endpoint{where} cannot be reached after {S3_ATTEMPTS} attempts ({cause})"
        )
    if "NoSuchBucket" in names:
        return BucketNotFoundError(
            f"{what}: the bucket does not exist{where}; create it first (ucp never creates buckets)"
        )
    return StorageError(f"{what}: {cause}")


# A request that fails to connect is tried this many times in all (botocore's standard retry mode, whose backoff
# is exponential with jitter, at most 20 s between attempts), each connect waiting at most S3_CONNECT_TIMEOUT_S:
# an unreachable endpoint fails a command within about 30 s. s3fs retries throttling ("SlowDown") on its own.
S3_ATTEMPTS = 3
S3_SINGLE_PUT_BYTES = 100 << 20  # s3fs puts an object below this in one request, larger ones in parts
S3_CONNECT_TIMEOUT_S = 10


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
        config.setdefault("retries", {"max_attempts": S3_ATTEMPTS, "mode": "standard"})
        config.setdefault("connect_timeout", S3_CONNECT_TIMEOUT_S)
        from botocore.config import Config  # (s3fs's dependency: imported only for S3)

        if "response_checksum_validation" in Config.OPTION_DEFAULTS:  # (botocore >= 1.36)
            # every byte ucp reads is checked against its own CRC-32C: botocore's check of a whole object's
            # checksum (~1/4 of a GET's client time on moto) would be a second pass over the same bytes
            config.setdefault("response_checksum_validation", "when_required")
        options["config_kwargs"] = config
        if "endpoint_url" not in options and os.environ.get("AWS_ENDPOINT_URL"):
            options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    if "::" not in protocol:  # (a chained URL names several: fsspec checks them itself)
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as e:  # not known, or its package is not installed
            raise StorageError(f"{url}: no storage for {protocol}:// ({e})") from None
    fs, root = fsspec.core.url_to_fs(url, **options)
    return FsspecStorage(fs, root, url)
