"""`LocalStorage`: plain POSIX files, with vectored writes, fsync for durability, direct reads into preallocated
buffers, and a thread that reads small objects ahead of a reader (`prefetching`).

It never follows a symbolic link below its root (neither a file's nor a directory's) and reads only regular files,
so a link or a FIFO planted in a checkpoint cannot redirect a write, a read or a removal, nor hang a read.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import functools
import os
import posixpath
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ..errors import NotAFileError, StateError, StorageError, UcpError
from .base import DEFAULT_IO_THREADS, Buffer, Capabilities, IOStats, Storage, check_relative_key, nothing_to_advance

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
NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOSYS})  # (what link says)


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
        self.capabilities = Capabilities(
            # In memory every write and read is a copy by a CPU: threads beyond two per core only contend (for the
            # GIL and the cores). Measured on 2 cores, 1 GiB to tmpfs: 4 threads save in 0.33-0.43 s, 16 in 0.55-0.63.
            io_threads=min(DEFAULT_IO_THREADS, 2 * (os.cpu_count() or 1)) if self.in_memory else DEFAULT_IO_THREADS,
            # A load from a disk: its large reads are the kernel's copies out of the read-ahead, then checksums, all
            # CPU. Measured on 2 cores, 1 GiB from a cold disk (980 objects): 8 threads 0.72-0.76 s, 16 0.80-0.88,
            # 4 0.77-0.79 (`bench_io coldstart`).
            read_threads=None if self.in_memory else min(DEFAULT_IO_THREADS, 4 * (os.cpu_count() or 1)),
            # A small write waits for its fsync (~1 ms on a disk): many in flight hide it. Without one it is CPU only,
            # as is a small read once `prefetching` has asked for it (20,000 small atoms from a cold disk: 3.2 s one
            # at a time, 4.2 s at 16 threads, 2.5 s at 2, 2.1 s one at a time with the read-ahead; warm, 1.1 s
            # against 1.6 s).
            serial_small_reads=True,
            serial_small_writes=self.in_memory or not fsync,
            exclusive_creates=True,  # (a hard link, or O_EXCL: `create_exclusive`)
            # a subclass may add behaviour (a test's failure injection) that a copy elsewhere would lack
            writer_process=type(self) is LocalStorage,
        )
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
        """Write the object whole. A new file is written in place; one that exists (an attempt's owner record renewed
        while gc or a test reads it) is replaced by a temporary file renamed over it, so that no reader sees it
        truncated, as an object store's overwrite is never seen half done."""
        path = self._path(key)
        try:
            if os.path.lexists(path):
                temp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"
                try:
                    total = self._write_file(temp, parts, os.O_EXCL)
                    os.replace(temp, path)
                finally:
                    if os.path.lexists(temp):
                        os.unlink(temp)
            else:
                try:
                    total = self._write_file(path, parts, os.O_TRUNC)
                except OSError:  # (a full disk: no object rather than a torn one, as a store's failed PUT leaves)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    raise
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
            try:
                self._write_file(temp, [data], os.O_EXCL)
                try:
                    os.link(temp, path, follow_symlinks=False)
                except OSError as e:
                    if e.errno not in NO_HARD_LINKS:
                        raise
                    self._write_file(path, [data], os.O_EXCL)
            finally:
                with contextlib.suppress(OSError):  # (also where its write failed: a full disk)
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
                threads = self.capabilities.io_threads
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
            yield nothing_to_advance
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
            yield nothing_to_advance
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

    def __reduce__(self) -> tuple:
        return (functools.partial(LocalStorage, fsync=self.fsync), (self.root,))
