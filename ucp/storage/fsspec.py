"""`FsspecStorage`: any fsspec filesystem (memory://, s3:// through s3fs, ...), one request per object write or range
read; what is S3's own is in `s3`, how its failures become ucp errors in `errors`."""

from __future__ import annotations

import errno
import logging
import posixpath
from collections.abc import Sequence
from typing import Any

import fsspec

from ..errors import BucketNotFoundError, StorageError, UcpError
from . import s3
from .base import Buffer, Capabilities, IOStats, Storage, check_relative_key
from .errors import precondition_failed, storage_error

log = logging.getLogger("ucp")

FSSPEC_IO_THREADS = 64  # an object store's latency is hidden by many requests (s3fs's pool is 64 connections)
# Where `create_exclusive` is atomic: S3's conditional put (If-None-Match: *), which AWS S3 and moto honour, and
# fsspec's memory and local file systems. Elsewhere it is a check, then a write.
EXCLUSIVE_CREATE_PROTOCOLS = s3.PROTOCOLS | {"memory", "file", "local"}


class FsspecStorage(Storage):
    """Any fsspec filesystem: memory://, s3:// (s3fs), ... One request per object write or range read."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.stats = IOStats()
        protocols = set(fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self._s3 = bool(s3.PROTOCOLS & protocols)
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
        except FileNotFoundError as e:  # a write creates any key: what is missing is the bucket
            raise BucketNotFoundError(
                f"cannot write {self.url.rstrip('/')}/{key}: the bucket does not exist; create it "
                "first (ucp never creates buckets)"
            ) from e
        except Exception as e:
            raise self._error("write", key, e) from e
        self.stats.record_write(key, len(data))

    def create_exclusive(self, key: str, data: bytes) -> None:
        if not self.capabilities.exclusive_creates:
            log.warning("%s cannot create objects exclusively: ucp assumes a single saver per step", self.url)
            if self.exists(key):
                raise FileExistsError(errno.EEXIST, "object exists", self._path(key))
        try:
            self.fs.pipe_file(self._path(key), bytes(data), mode="create", **self._put_checksum(data))
        except FileExistsError:
            raise
        except Exception as e:
            # (s3fs raises FileExistsError where the store names the condition; one that answers a bare 412 is
            # told apart by the response botocore parsed)
            if precondition_failed(e):
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
        return (FsspecStorage, (self.fs, self.root, self.url))


def _stamp(info: dict[str, Any]) -> float | None:
    """The modification time in an fsspec `info` entry (S3's LastModified, a file system's mtime), if any."""
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
    if stamp is None:
        return None
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)
