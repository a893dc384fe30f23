"""Which store a URL names: `open_storage`."""

from __future__ import annotations

import os
from typing import Any

import fsspec

from ..errors import CheckpointNotFoundError, StorageError, UcpError
from . import s3
from .base import SINGLE_WRITER_OPTION, Storage
from .fsspec import FsspecStorage
from .local import LocalStorage


def open_storage(url: str, storage_options: dict[str, Any] | None = None, *, fsync: bool = True) -> Storage:
    """A storage for a local path, file://, memory://, s3:// or any other fsspec URL.

    S3 endpoint and credentials come from `storage_options` (s3fs arguments such as endpoint_url, key,
    secret) or the standard AWS environment variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). One option is
    ucp's own, taken out before the others reach fsspec: `single_writer` (true: accept a store whose creates are not
    exclusive, for one process saving each step; `Capabilities.exclusive_creates`).
    """
    if not isinstance(url, str) or not url:
        raise CheckpointNotFoundError(f"a checkpoint URL must be a non-empty string, got {url!r}")
    options = dict(storage_options or {})
    single_writer = options.pop(SINGLE_WRITER_OPTION, False)
    if not isinstance(single_writer, bool):
        raise StorageError(f"{url}: the storage option {SINGLE_WRITER_OPTION} is true or false, not {single_writer!r}")
    protocol, scheme, rest = url.partition("://")
    if not scheme:
        return LocalStorage(url, fsync=fsync)
    if not rest and protocol in s3.PROTOCOLS:
        raise CheckpointNotFoundError(f"{url} names no bucket: give s3://BUCKET/PREFIX")
    if protocol == "file":
        return LocalStorage(rest, fsync=fsync)
    if protocol in s3.PROTOCOLS:
        options = s3.client_options(options, dict(os.environ))
    if "::" not in protocol:  # (a chained URL names several: fsspec checks them itself)
        try:
            fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as e:  # not known, or its package is not installed
            raise StorageError(f"{url}: no storage for {protocol}:// ({e})") from None
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except UcpError:
        raise
    except Exception as e:  # (a file system connects or opens its container here and raises anything: ftp a
        # refused connection or an unknown host, zip a file that is not one)
        raise StorageError(f"cannot open {url}: {type(e).__name__}: {e}") from e
    return FsspecStorage(fs, root, url, single_writer=single_writer)
