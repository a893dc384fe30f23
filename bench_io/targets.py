"""Where the benchmark writes (tmpfs, local disk, S3), and how each target is made cold before a read.

MLPerf Storage's rule: a read must not be served from the page cache filled by the write before it. As root
we write 1 to /proc/sys/vm/drop_caches (clean page cache, system wide); otherwise posix_fadvise(DONTNEED) on
every file (clean pages only, which fsync guarantees). Either way we then ask mincore how much of the files
is still resident, and report that with the method, so a warm read is never passed off as a cold one.
On tmpfs the page cache *is* the storage: nothing can be dropped, and the report says so.

S3: with no endpoint given, a `moto_server` subprocess on 127.0.0.1 (its own process, so the server does not
share the benchmark's GIL) makes the command run anywhere; `--endpoint-url` / AWS_ENDPOINT_URL and the AWS
credentials in the environment point it at a real S3 or MinIO. An object store has no page cache to drop:
every read goes over the network ("s3" in the cache column).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from trainer.launch import free_port
from ucp.storage import file_system_type

CACHE_MODES = ("auto", "drop_caches", "fadvise", "none")


def fs_type(path: str | Path) -> str:
    """The file system type of the mount holding `path`, "unknown" where that cannot be told."""
    return file_system_type(str(path)) or "unknown"


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


# ------------------------------------------------------------------------------------------------- S3


@dataclass(frozen=True)
class RemoteDir:
    """A 'directory' (key prefix) in an object store: what methods get instead of a Path on the s3 target."""

    url: str  # s3://bucket/prefix
    storage_options: dict[str, Any]

    def __truediv__(self, name: str) -> RemoteDir:
        return RemoteDir(f"{self.url.rstrip('/')}/{name}", self.storage_options)

    @property
    def path(self) -> str:
        """bucket/prefix, the form s3fs's methods take."""
        return self.url.split("://", 1)[1]

    @property
    def fs(self) -> Any:
        return s3_filesystem(self.storage_options)


class S3Requests:
    """Counts the S3 API calls this process makes while it is entered, by operation (PutObject, GetObject, ...):
    every s3fs client of the process is an aiobotocore client, whose one entry point for a call is wrapped. Calls
    made by another process (an async save's writer process) are not counted."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __enter__(self) -> Self:
        from aiobotocore.client import AioBaseClient

        self._real = real = AioBaseClient._make_api_call
        calls = self.calls

        async def counted(client: Any, operation: str, params: Any) -> Any:
            calls[operation] = calls.get(operation, 0) + 1
            return await real(client, operation, params)

        AioBaseClient._make_api_call = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from aiobotocore.client import AioBaseClient

        AioBaseClient._make_api_call = self._real  # type: ignore[method-assign]

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def s3_filesystem(storage_options: dict[str, Any]) -> Any:
    """An s3fs filesystem with a connection pool big enough for many requests in flight (fsspec caches it)."""
    import s3fs

    options = dict(storage_options)
    config = dict(options.pop("config_kwargs", {}) or {})
    config.setdefault("max_pool_connections", 64)
    return s3fs.S3FileSystem(use_listings_cache=False, config_kwargs=config, **options)


class MotoServer:
    """moto's S3 server as a subprocess on 127.0.0.1 (not a thread: it would share our GIL)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        self.proc = subprocess.Popen(
            [*cmd, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("moto_server did not start within 30 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class S3Target(Target):
    """A fresh prefix in a bucket; `root` is a RemoteDir. Owns the embedded server when it started one."""

    server: MotoServer | None = None
    bucket_owned: bool = False

    def workdir(self, label: str) -> RemoteDir:  # type: ignore[override]
        self._count += 1
        return self.root / f"{self._count:04d}-{label}"  # type: ignore[operator, return-value]

    def make_cold(self, directory: Any, mode: str) -> tuple[str, float | None]:
        return "s3", None

    def remove(self, directory: Any) -> None:
        try:
            directory.fs.rm(directory.path, recursive=True)
        except (FileNotFoundError, OSError):
            pass

    def close(self) -> None:
        try:
            root: RemoteDir = self.root  # type: ignore[assignment]
            self.remove(root)
            if self.bucket_owned:
                root.fs.rmdir(root.path.split("/", 1)[0])
        except Exception as e:  # noqa: BLE001 -- cleanup of a scratch bucket must not hide the figures
            print(f"bench_io: could not remove {self.root}: {e}", file=sys.stderr)
        finally:
            if self.server is not None:
                self.server.close()


def s3_target(
    disk_dir: str | None,
    endpoint_url: str | None = None,
    bucket: str | None = None,
    options: dict[str, Any] | None = None,
) -> Target:
    """The s3 target: `endpoint_url` (or the options' endpoint_url, or AWS_ENDPOINT_URL) with the credentials of
    `options` (s3fs storage options: key, secret, profile, ...) or the AWS environment, or an embedded moto server
    when no endpoint is given. A scratch bucket is made (and removed) unless `bucket` is named."""
    options = dict(options or {})
    endpoint_url = endpoint_url or options.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
    server = None
    if endpoint_url is None:
        server = MotoServer()
        endpoint_url = server.url
        options.update(key="testing", secret="testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # botocore wants one; moto takes any
    options["endpoint_url"] = endpoint_url
    owned = bucket is None
    bucket = bucket or f"bench-io-{uuid.uuid4().hex[:12]}"
    try:
        fs = s3_filesystem(options)
        if owned:
            fs.mkdir(bucket)
    except Exception:
        if server is not None:
            server.close()
        raise
    root = RemoteDir(f"s3://{bucket}/bench_io-{uuid.uuid4().hex[:8]}", options)
    t = S3Target("s3", root, f"s3 ({'moto, embedded' if server else endpoint_url})", volatile=False)  # type: ignore[arg-type]
    t.server, t.bucket_owned = server, owned
    return t


def is_remote(directory: object) -> bool:
    return isinstance(directory, RemoteDir)


# name -> factory(--dir, **s3 options)
TARGETS: dict[str, Callable[..., Target]] = {"tmpfs": tmpfs_target, "disk": disk_target, "s3": s3_target}
DEFAULT_TARGETS = ("tmpfs", "disk", "s3")
