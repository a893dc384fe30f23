"""The exceptions ucp raises. Every message names the problem: which checkpoint, atom, chunk or value."""


class UcpError(Exception):
    """Base class of every error ucp raises on purpose. Each subclass is known by its name (`error_kind`), so that a
    failure on one rank of a save is raised on every rank as the same type, whichever module defines it."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _KINDS[cls.__name__] = cls


_KINDS: dict[str, type[UcpError]] = {"UcpError": UcpError}


def error_kind(name: str) -> type[UcpError] | None:
    """The ucp error class called `name` (any defined so far, the interop ones included), or None."""
    return _KINDS.get(name)


class LayoutError(UcpError, ValueError):
    """A layout string is malformed or does not fit the world size or the model."""


class CheckpointNotFoundError(UcpError):
    """The URL holds no ucp checkpoint, or not the requested (committed) step."""


class StepRemovedError(CheckpointNotFoundError):
    """The step was deleted (by retention, or another job's `delete`) while it was being read: nothing is damaged."""


class FormatError(UcpError):
    """Metadata is missing, malformed, or disagrees with itself or with the data."""


class UnsupportedVersionError(FormatError):
    """The checkpoint was written by a newer major version of the format."""


class IntegrityError(UcpError):
    """Stored bytes are missing, truncated or fail their checksum."""


class ObjectMissingError(IntegrityError):
    """An object that the committed manifest names is not there (deleted, or never written)."""


class StateError(UcpError):
    """A state handed to save (or a target handed to load) has a shape ucp cannot store or fill."""


class StepExistsError(UcpError):
    """A save targets a step that is already committed (committed steps are never overwritten)."""


class WriterProcessError(UcpError):
    """The writer process of async saves could not be started or died while a save was in flight."""


class PeerLostError(UcpError):
    """A collective of a distributed save or load failed on this rank: another process of the job is gone or cannot
    be reached (the process group's own error is in the message). The job must re-form its group: ucp never goes on
    to its next collective after one failed, which the other ranks would not be in step with."""


class StorageError(UcpError):
    """A storage operation failed for a reason other than damaged data: no space, no permission, an unreachable
    or refusing object store, a path that is not a regular file or that passes through a symbolic link."""


class StorageAuthError(StorageError):
    """The store refused the credentials it was given, or none were found."""


class StorageUnreachableError(StorageError):
    """The store's endpoint could not be reached (connection refused or timed out, after the retries)."""


class BucketNotFoundError(StorageError):
    """The bucket that the URL names does not exist (ucp never creates buckets)."""


class NonExclusiveStoreError(StorageError):
    """The store does not honour exclusive creates (an S3-compatible store or gateway that ignores If-None-Match), so
    ucp cannot commit there: two saves of one step could both commit. Opened with the storage option
    `single_writer=true` (one process saving each step), ucp checks, then writes, instead."""


class ReadOnlyStorageError(StorageError):
    """A store that can only be read (a hot tier's restore source) was handed to a save."""


class NotAFileError(StorageError):
    """Where an object should be, the local file system has something else (a FIFO, a device, a symbolic link):
    ucp never opens it, so it can neither hang a read nor redirect one."""
