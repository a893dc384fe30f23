"""Where the benchmark writes (tmpfs, local disk, S3), and how each target is made cold before a read.

MLPerf Storage's rule: a read must not be served from the page cache filled by the write before it. As root
we write 1 to /proc/sys/vm/drop_caches (clean page cache, system wide); otherwise posix_fadvise(DONTNEED) on
every file (clean pages only, which fsync guarantees). Either way we then ask mincore how much of the files
is still resident, and report that with the method, so a warm read is never passed off as a cold one.
On tmpfs the page cache *is* the storage: nothing can be dropped, and the report says so.

S3: with no endpoint given, a server of its own on 127.0.0.1 (`s3_servers`: Ceph's radosgw where Debian's packages
are installed, a real implementation; else moto's, a Python mock that runs anywhere, in a process of its own so that
it does not share the benchmark's GIL; `--s3-server` chooses), in a scratch bucket of its own; `--endpoint-url` /
AWS_ENDPOINT_URL and the AWS credentials in the environment point it at a real S3 or MinIO, under a fresh prefix of
an existing `--bucket` (the benchmark never creates one there). Before anything is measured, `check_s3` lists the
prefix and the target's probe writes, reads and deletes a few objects under it, so that credentials, endpoint,
bucket and permissions fail in one line (ucp's StorageError kinds) rather than in every method. An object store has
no page cache to drop: every read goes over the network ("s3" in the cache column).

Every target is probed before the run (`probe`: a few objects written, read back and deleted through ucp's storage
layer) so that the command can say how long the run will take before it starts.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ucp.errors import BucketNotFoundError, StorageError, UcpError
from ucp.storage import Storage, file_system_type, open_storage, storage_error
from ucp.storage.base import SINGLE_WRITER_OPTION
from ucp.storage.s3 import client_options

from .s3_servers import S3Server, radosgw_missing, s3_server_version, start_s3_server

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

    def storage(self) -> Storage:
        """ucp's storage at the target's root (what `probe` writes through)."""
        return open_storage(str(self.root))

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class Probe:
    """A target's speed, measured before the run: bytes per second written and read with many objects in flight
    (each object written durably), and the seconds of one small object's write and read (a request's cost)."""

    write_bps: float
    read_bps: float
    request_s: float

    def seconds(self, nbytes: int, objects: int, in_flight: int) -> float:
        """A rough time for saving and loading `nbytes` in `objects` objects, `in_flight` at a time."""
        return nbytes / self.write_bps + nbytes / self.read_bps + 2 * objects * self.request_s / max(1, in_flight)


PROBE_OBJECTS, PROBE_OBJECT_BYTES = 8, 2 << 20


def probe(target: Target) -> Probe:
    """Write, read back and delete PROBE_OBJECTS objects of PROBE_OBJECT_BYTES (all in flight at once) and one small
    object, under a probe prefix of the target's root (removed afterwards). Storage errors are ucp's (one line)."""
    import concurrent.futures as cf

    storage = target.storage()
    prefix = f"_probe-{uuid.uuid4().hex[:8]}"
    data = os.urandom(PROBE_OBJECT_BYTES)
    keys = [f"{prefix}/{i}" for i in range(PROBE_OBJECTS)]
    try:
        with cf.ThreadPoolExecutor(PROBE_OBJECTS) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda key: storage.write(key, [data]), keys))
            storage.flush()
            t1 = time.perf_counter()
            read = list(pool.map(lambda key: bytes(storage.read(key)), keys))
            t2 = time.perf_counter()
        if any(r != data for r in read):
            raise StorageError(
                f"{target.name}: the probe objects under {getattr(target.root, 'url', target.root)} "
                "came back different from what was written"
            )
        t3 = time.perf_counter()
        storage.write(f"{prefix}/small", [b"x" * 4096])
        storage.flush()
        storage.read(f"{prefix}/small")
        t4 = time.perf_counter()
    finally:
        storage.delete(prefix)
    total = PROBE_OBJECTS * PROBE_OBJECT_BYTES
    return Probe(total / max(t1 - t0, 1e-6), total / max(t2 - t1, 1e-6), (t4 - t3) / 2)


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
    def fsspec_options(self) -> dict[str, Any]:
        """The storage options without ucp's own (`single_writer`): what another library's fsspec client takes."""
        return {k: v for k, v in self.storage_options.items() if k != SINGLE_WRITER_OPTION}

    @property
    def fs(self) -> Any:
        return s3_filesystem(self.fsspec_options)


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
    """An s3fs file system (fsspec caches it) configured as ucp configures its own (`client_options`: a connection
    pool as large as the requests in flight, no SHA-256 of every body, no check of a whole object's checksum on
    reads), and without the checksum botocore puts on every upload by default: what raw measures is the transport
    alone, the floor under ucp's own checksums."""
    import s3fs
    from botocore.config import Config

    options = client_options(storage_options, dict(os.environ))
    if "request_checksum_calculation" in Config.OPTION_DEFAULTS:  # (botocore >= 1.36)
        options["config_kwargs"].setdefault("request_checksum_calculation", "when_required")
    return s3fs.S3FileSystem(**options)


class S3Target(Target):
    """A fresh prefix in a bucket; `root` is a RemoteDir. Owns the embedded server when it started one."""

    server: S3Server | None = None
    bucket_owned: bool = False

    @property
    def server_kind(self) -> str | None:
        """The kind of server it started ("moto", "radosgw"), None on an endpoint given."""
        return self.server.endpoint.server if self.server is not None else None

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

    def storage(self) -> Storage:
        root: RemoteDir = self.root  # type: ignore[assignment]
        return open_storage(root.url, root.storage_options)

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
    server: str | None = None,
) -> Target:
    """The s3 target: `endpoint_url` (or the options' endpoint_url, or AWS_ENDPOINT_URL) with the credentials of
    `options` (s3fs storage options: key, secret, profile, ...) or the AWS environment, under a fresh prefix of the
    existing `bucket`; or, when no endpoint is given, a server of its own (`server`: radosgw, moto, or None / "auto":
    radosgw where installed, else moto) and a scratch bucket on it (removed afterwards, with the server). Checked
    before it is returned (`check_s3`): a UcpError names what is wrong."""
    options = dict(options or {})
    endpoint_url = endpoint_url or options.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint_url is not None and bucket is None:
        raise UcpError(
            f"--bucket: name an existing bucket on {endpoint_url} to write under (the benchmark works under a fresh "
            "prefix of it and removes it; it creates no bucket on a store of yours)"
        )
    if bucket is not None and "://" in bucket:
        raise UcpError(f"--bucket {bucket}: a bucket's name (and a prefix under it: BUCKET/PREFIX), not a URL")
    started = None
    if endpoint_url is None:
        started = start_s3_server(embedded_server(server))
        endpoint_url = started.endpoint.url
        options.update(key=started.endpoint.key, secret=started.endpoint.secret)
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # botocore wants one; the servers take any
    options["endpoint_url"] = endpoint_url
    owned = bucket is None
    bucket = bucket or f"bench-io-{uuid.uuid4().hex[:12]}"
    root = RemoteDir(f"s3://{bucket}/bench_io-{uuid.uuid4().hex[:8]}", options)
    try:
        if owned:
            s3_filesystem(options).mkdir(bucket)  # (on the embedded server only)
        check_s3(root)
    except BaseException:
        if started is not None:
            started.close()
        raise
    where = f"{started.endpoint.server}, embedded" if started else endpoint_url
    t = S3Target("s3", root, f"s3 ({where})", volatile=False)  # type: ignore[arg-type]
    t.server, t.bucket_owned = started, owned
    return t


def embedded_server(choice: str | None) -> str:
    """The server `--s3-server` names: radosgw or moto as asked (radosgw refused in one line where it is not
    installed), or for "auto" (None) radosgw where it is installed, else moto."""
    missing = radosgw_missing()
    if choice in (None, "auto"):
        return "moto" if missing else "radosgw"
    if choice == "radosgw" and missing:
        raise UcpError(f"--s3-server radosgw: {missing}")
    return choice


def s3_server_of(target: Target) -> str | None:
    """What serves an S3 target, for the report: the embedded server with its version ("radosgw 16.2.15", "moto
    5.2.6"), or the endpoint given; None for a local target."""
    if not isinstance(target, S3Target):
        return None
    if target.server_kind is None:
        return str(target.root.storage_options.get("endpoint_url"))  # type: ignore[attr-defined]
    return f"{target.server_kind} {s3_server_version(target.server_kind)}"


def check_s3(root: RemoteDir) -> None:
    """That `root`'s endpoint speaks S3, takes the credentials and holds the bucket: a listing of the (empty) prefix,
    whose failure becomes ucp's error for it (StorageAuthError, StorageUnreachableError, BucketNotFoundError), or a
    StorageError saying that the endpoint is not an S3 endpoint (an HTTP server whose answer is not S3's). Writing,
    reading and deleting under the prefix are checked by the target's `probe`."""
    storage = open_storage(root.url, root.storage_options)
    bucket, _, prefix = root.path.partition("/")
    endpoint = root.storage_options.get("endpoint_url")
    try:
        listing = storage.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/", MaxKeys=1)
    except Exception as e:
        # (s3fs raises its own exception from botocore's, whose `response` holds the HTTP status and S3's error code)
        response = next((x.response for x in (e, e.__cause__) if isinstance(getattr(x, "response", None), dict)), None)
        code = str(((response or {}).get("Error") or {}).get("Code", ""))
        if response is not None and (not code or code.isdigit()):  # an HTTP status, no S3 error document
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", code)
            raise StorageError(
                f"cannot list {root.url}: {endpoint} is not an S3 endpoint (it answered a bucket listing with HTTP "
                f"{status} and no S3 error); give the S3 API's URL (--endpoint-url)"
            ) from e
        if code == "NoSuchBucket":
            raise BucketNotFoundError(
                f"cannot list {root.url}: the bucket {bucket!r} does not exist ({endpoint}); name an existing one "
                "with --bucket (the benchmark creates none)"
            ) from e
        raise storage_error(f"cannot list {root.url}", e, storage.fs) from e
    if not isinstance(listing, dict) or not {"Name", "KeyCount", "Prefix"} & set(listing):
        raise StorageError(
            f"cannot list {root.url}: {endpoint} is not an S3 endpoint (its answer to a bucket listing is not S3's); "
            "give the S3 API's URL (--endpoint-url)"
        )


def is_remote(directory: object) -> bool:
    return isinstance(directory, RemoteDir)


# name -> factory(--dir, **s3 options)
TARGETS: dict[str, Callable[..., Target]] = {"tmpfs": tmpfs_target, "disk": disk_target, "s3": s3_target}
DEFAULT_TARGETS = ("tmpfs", "disk", "s3")
