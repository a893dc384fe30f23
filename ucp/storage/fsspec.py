"""`FsspecStorage`: any fsspec filesystem (memory://, s3:// through s3fs, ...), one request per object write or range
read; what is S3's own is in `s3`, how its failures become ucp errors in `errors`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import posixpath
import threading
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import fsspec
import fsspec.asyn

from ..base.heap import populate
from ..errors import NonExclusiveStoreError, StorageError, UcpError
from . import s3
from .base import SINGLE_WRITER_OPTION, Buffer, Capabilities, IOStats, Storage, check_relative_key
from .errors import object_missing, precondition_failed, range_not_satisfiable, storage_error
from .s3_direct import DirectReads

log = logging.getLogger("ucp")

FSSPEC_IO_THREADS = 64  # an object store's latency is hidden by many requests (s3fs's pool is 64 connections)
# Where `create_exclusive` is atomic: S3's conditional put (If-None-Match: *), once a probe has shown that the store
# honours it (AWS S3, moto and radosgw do), and fsspec's memory and local file systems.
EXCLUSIVE_CREATE_PROTOCOLS = s3.PROTOCOLS | {"memory", "file", "local"}

# (endpoint, bucket) -> whether the store refused a second conditional put of one key: probed once per process
_CONDITIONAL_PUTS: dict[tuple[str | None, str], bool] = {}
_PROBE_LOCK = threading.Lock()


class FsspecStorage(Storage):
    """Any fsspec filesystem: memory://, s3:// (s3fs), ... One request per object write or range read.
    `single_writer`: accept creates that are not exclusive (`Capabilities.exclusive_creates`)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str, single_writer: bool = False):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.single_writer = single_writer
        self.stats = IOStats()
        protocols = set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self._s3 = bool(s3.PROTOCOLS & protocols)
        self._direct: DirectReads | None | bool = False  # (False: not yet made; None: this store reads through s3fs)
        self._direct_lock = threading.Lock()
        self.capabilities = Capabilities(
            io_threads=FSSPEC_IO_THREADS,
            whole_object_reads=True,
            exclusive_creates=bool(EXCLUSIVE_CREATE_PROTOCOLS & protocols),
            # (a copy in another process has a memory of its own; a subclass may add what a copy would lack)
            writer_process=type(self) is FsspecStorage and "memory" not in protocols,
        )

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_relative_key(key)}" if key else self.root

    def _error(self, doing: str, key: str, e: BaseException) -> StorageError:
        return storage_error(f"cannot {doing} {self.url.rstrip('/')}/{key}", e, self.fs)

    def _put_checksum(self, data: Buffer) -> dict[str, str]:
        return s3.put_checksum(data) if self._s3 else {}

    def write(self, key: str, parts: Sequence[Buffer]) -> None:
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        try:
            self.fs.pipe_file(self._path(key), bytes(data), **self._put_checksum(data))
        except UcpError:
            raise
        except Exception as e:  # (a missing bucket too: a write creates any key)
            raise self._error("write", key, e) from e
        self.stats.record_write(key, len(data))

    def create_exclusive(self, key: str, data: bytes) -> None:
        if not self._creates_exclusively():
            if not self.single_writer:
                raise NonExclusiveStoreError(
                    f"cannot create {self.url.rstrip('/')}/{key} exclusively: {self._why_not_exclusive()}, so two saves"
                    " of one step could both commit; save to a store that honours conditional writes (AWS S3, Ceph"
                    f" radosgw, MinIO) or, if one process alone saves each step, give the storage option "
                    f"{SINGLE_WRITER_OPTION}=true (-o {SINGLE_WRITER_OPTION}=true): a create is then a check, then a"
                    " write"
                )
            log.info(
                "%s cannot create objects exclusively: %s=true, one saver per step", self.url, SINGLE_WRITER_OPTION
            )
            if self.exists(key):
                raise FileExistsError(errno.EEXIST, "object exists", self._path(key))
        self._create(key, data)
        self.stats.record_write(key, len(data))

    def _create(self, key: str, data: bytes) -> None:
        """A conditional put of the whole object (If-None-Match: *; `mode="create"` elsewhere), in one request on S3
        whatever its size: a store may ignore the condition on a multipart upload's completion (radosgw does, and
        overwrites). FileExistsError if the store refused it because the key exists (HTTP 412), by its answer."""
        path = self._path(key)
        single = {}
        if self._s3:
            if len(data) > s3.S3_MAX_PUT_BYTES:
                raise StorageError(
                    f"cannot create {self.url.rstrip('/')}/{key} exclusively: {len(data)} bytes is more than one S3 "
                    f"put takes ({s3.S3_MAX_PUT_BYTES} bytes)"
                )
            single = {"chunksize": s3.S3_MAX_PUT_BYTES, **s3.put_checksum(data, single_put=True)}
        try:
            self.fs.pipe_file(path, bytes(data), mode="create", **single)
        except Exception as e:
            if precondition_failed(e):
                raise FileExistsError(errno.EEXIST, "object exists", path) from e
            raise self._error("create", key, e) from e

    def _creates_exclusively(self) -> bool:
        """Whether a create is exclusive here: what the file system promises, and on S3 what the store does (a
        probe, once per endpoint and bucket in this process, whose answer the capabilities then declare)."""
        if self._s3 and self.capabilities.exclusive_creates and not self._conditional_puts_honoured():
            self.capabilities = replace(self.capabilities, exclusive_creates=False)
        return self.capabilities.exclusive_creates

    def _conditional_puts_honoured(self) -> bool:
        """Whether the store refuses a second conditional put of one key: a probe on a key of its own under the root
        (created twice, then removed), before anything relies on it."""
        where = (s3.endpoint_of(self.fs), self.root.split("/", 1)[0])
        with _PROBE_LOCK:
            if where not in _CONDITIONAL_PUTS:
                key = f"{s3.EXCLUSIVE_PROBE_KEY}-{uuid.uuid4().hex}"
                try:
                    self._create(key, b"first")
                    self._create(key, b"second")
                    honoured = False
                except FileExistsError:  # (the second; or the first, whose retry met its own first success)
                    honoured = True
                except BaseException:
                    with contextlib.suppress(StorageError):  # (the probe's failure is what to say)
                        self.delete(key)
                    raise
                self.delete(key)
                _CONDITIONAL_PUTS[where] = honoured
                if not honoured:
                    log.warning("%s: the store ignores If-None-Match: its creates are not exclusive", self.url)
            return _CONDITIONAL_PUTS[where]

    def _why_not_exclusive(self) -> str:
        if self._s3:
            endpoint = s3.endpoint_of(self.fs) or "AWS S3"
            return f"the store at {endpoint} ignores conditional writes (a second put of one key with If-None-Match: * was not refused)"
        return f"this file system ({type(self.fs).__name__}) cannot create objects exclusively"

    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        path = self._path(key)
        try:
            if self._s3:  # (s3fs's cat_file takes any success's body as the range: `s3.get_bytes` checks it)
                data = fsspec.asyn.sync(self.fs.loop, s3.get_bytes, self.fs, path, start, end)
            else:  # (a start of 0 is given, a range: without one a file system may first ask for the size)
                data = self.fs.cat_file(path, start=start, end=end)
        except Exception as e:
            failure = self._unreadable(key, path, e)
            if failure is not None:
                raise failure from e
            data = b""
        self.stats.record_read(len(data))
        return memoryview(data)

    def _unreadable(self, key: str, path: str, e: Exception) -> Exception | None:
        """A failed read as what to raise, told by the store's answer: FileNotFoundError for a missing object, a
        storage error for anything else; None for a range at or past the object's end (an empty object's included):
        no bytes, as a file read past its end gives none."""
        if range_not_satisfiable(e):
            return None
        if object_missing(e):
            return FileNotFoundError(errno.ENOENT, "no such object", path)
        return self._error("read", key, e)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        if not self._s3:
            return super().read_into(key, offset, buffers)
        path = self._path(key)
        direct = self._direct_reads()
        if direct is not None and direct.disabled is None and sum(b.nbytes for b in buffers) <= s3.S3_PART_READ_BYTES:
            bucket, object_key, _ = self.fs.split_path(path)
            got = direct.get_into(bucket, object_key, offset, buffers)
            if got is not None:
                self.stats.record_read(got)
                return got
        populate(buffers)  # (here: the event loop thread copies every response into them, taking their faults there)
        try:  # (streamed into the buffers: no copy of the whole body first)
            got = fsspec.asyn.sync(self.fs.loop, self._get_parts, path, offset, buffers)
        except Exception as e:
            failure = self._unreadable(key, path, e)
            if failure is not None:
                raise failure from e
            got = 0
        self.stats.record_read(got)
        return got

    def _direct_reads(self) -> DirectReads | None:
        """GETs made from the reading thread (`s3_direct`), where this file system's configuration allows them."""
        if self._direct is False:
            with self._direct_lock:
                if self._direct is False:
                    try:
                        self._direct = DirectReads.of(self.fs)
                    except Exception as e:  # noqa: BLE001 -- the client's failure is botocore's read's to tell
                        log.info("S3 reads go through botocore: %r", e)
                        self._direct = None
        return self._direct  # type: ignore[return-value]

    async def _get_parts(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """The bytes from `offset` into `buffers` (`s3.get_into`), in ranged GETs of at most `s3.S3_PART_READ_BYTES`
        all in flight at once; the bytes read (a part past the object's end reads none). The first failure is raised
        once every part has ended (none then writes into the buffers any more)."""
        parts = s3.read_parts(offset, buffers)
        if len(parts) == 1:
            return await s3.get_into(self.fs, path, offset, buffers)
        results = await asyncio.gather(
            *(s3.get_into(self.fs, path, at, views) for at, views in parts), return_exceptions=True
        )
        failed = next((r for r in results if isinstance(r, BaseException) and not range_not_satisfiable(r)), None)
        if failed is not None:
            raise failed
        return sum(r for r in results if isinstance(r, int))

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
        except Exception as e:
            if object_missing(e) or isinstance(e, NotADirectoryError):
                return []
            raise self._error("list", key or "(root)", e) from e
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        names.discard("")
        return sorted(names)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.fs.rm(path, recursive=True)
        except Exception as e:
            if not object_missing(e):
                raise self._error("delete", key, e) from e

    def root_exists(self) -> bool:
        try:
            if self._s3:
                s3.check_bucket(self.fs, self.root, self.url)
                return True
            return bool(self.fs.exists(self.root))
        except UcpError:
            raise
        except Exception as e:
            raise storage_error(f"cannot look up {self.url}", e, self.fs) from e

    def __reduce__(self) -> tuple:
        return (FsspecStorage, (self.fs, self.root, self.url, self.single_writer))


def _stamp(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec `info` entry (S3's LastModified, a file system's mtime), if any."""
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
    if stamp is None:
        return None
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)
