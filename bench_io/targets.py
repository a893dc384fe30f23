"""Where the benchmark writes (tmpfs, local disk; S3 later), and how each target is made cold before a read.

MLPerf Storage's rule: a read must not be served from the page cache filled by the write before it. As root
we write 1 to /proc/sys/vm/drop_caches (clean page cache, system wide); otherwise posix_fadvise(DONTNEED) on
every file (clean pages only, which fsync guarantees). Either way we then ask mincore how much of the files
is still resident, and report that with the method, so a warm read is never passed off as a cold one.
On tmpfs the page cache *is* the storage: nothing can be dropped, and the report says so.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

CACHE_MODES = ("auto", "drop_caches", "fadvise", "none")


def fs_type(path: str | Path) -> str:
    """The filesystem type of the mount holding `path` (longest matching mount point in /proc/mounts)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def iter_files(directory: Path) -> Iterator[Path]:
    for base, _, names in os.walk(directory):
        for name in names:
            yield Path(base, name)


# ------------------------------------------------------------------------------------------ page cache

_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def resident_fraction(directory: Path) -> float | None:
    """Fraction of the files' pages in the page cache (mincore); None where it cannot be measured."""
    try:
        libc = _load_libc()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    total = resident = 0
    for path in iter_files(directory):
        size = path.stat().st_size
        if not size:
            continue
        pages = -(-size // page)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in bytes(vec))
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0


def drop_page_cache(directory: Path, mode: str = "auto") -> str:
    """Evict `directory`'s files from the page cache; returns the method that was used ('drop_caches',
    'fadvise') or 'none' when nothing could be done (the read that follows is warm)."""
    if mode in ("auto", "drop_caches"):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            if mode == "drop_caches":
                return "none"
    if mode in ("auto", "fadvise") and hasattr(os, "posix_fadvise"):
        try:
            for path in iter_files(directory):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # DONTNEED skips dirty pages
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            return "fadvise"
        except OSError:
            pass
    return "none"


# --------------------------------------------------------------------------------------------- targets


@dataclass
class Target:
    """A directory tree on one kind of storage. `workdir` hands out fresh directories (a fresh checkpoint
    root per measurement: ucp refuses to overwrite a step, and leftovers would skew the next write)."""

    name: str
    root: Path
    fstype: str
    volatile: bool  # memory-backed: no cache to drop, fsync is free
    _owned: bool = True
    _count: int = 0

    def workdir(self, label: str) -> Path:
        self._count += 1
        path = self.root / f"{self._count:04d}-{label}"
        path.mkdir(parents=True)
        return path

    def make_cold(self, directory: Path, mode: str) -> tuple[str, float | None]:
        """Prepare a read of `directory`: (cache method, fraction still resident afterwards)."""
        if self.volatile:
            return "tmpfs", None
        method = "none" if mode == "none" else drop_page_cache(directory, mode)
        return method, resident_fraction(directory)

    def remove(self, directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


def _scratch(parent: str | Path, name: str, volatile: bool) -> Target:
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_io-", dir=parent))
    kind = fs_type(root)
    return Target(name, root, kind, volatile=volatile or kind in ("tmpfs", "ramfs"))


def tmpfs_target(disk_dir: str | None) -> Target:
    if fs_type("/dev/shm") not in ("tmpfs", "ramfs"):
        raise RuntimeError("/dev/shm is not a tmpfs on this machine")
    return _scratch("/dev/shm", "tmpfs", volatile=True)


def disk_target(disk_dir: str | None) -> Target:
    # /var/tmp, unlike /tmp, is disk-backed on nearly every distribution
    return _scratch(disk_dir or "/var/tmp", "disk", volatile=False)


# name -> factory(--dir); a later issue adds s3 (a moto server on loopback, or a real endpoint)
TARGETS: dict[str, Callable[[str | None], Target]] = {"tmpfs": tmpfs_target, "disk": disk_target}
