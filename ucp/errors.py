"""The exceptions ucp raises. Every message names the problem: which checkpoint, atom, chunk or value."""


class UcpError(Exception):
    """Base class of every error ucp raises on purpose."""


class LayoutError(UcpError, ValueError):
    """A layout string is malformed or does not fit the world size or the model."""


class CheckpointNotFoundError(UcpError):
    """The URL holds no ucp checkpoint, or not the requested (committed) step."""


class FormatError(UcpError):
    """Metadata is missing, malformed, or disagrees with itself or with the data."""


class UnsupportedVersionError(FormatError):
    """The checkpoint was written by a newer major version of the format."""


class IntegrityError(UcpError):
    """Stored bytes are missing, truncated or fail their checksum."""


class StateError(UcpError):
    """A state handed to save (or a target handed to load) has a shape ucp cannot store or fill."""


class StepExistsError(UcpError):
    """A save targets a step that is already committed (committed steps are never overwritten)."""


class WriterProcessError(UcpError):
    """The writer process of async saves could not be started or died while a save was in flight."""


class StorageError(UcpError):
    """A storage operation failed for a reason other than damaged data: no space, no permission, an unreachable
    or refusing object store, a path that is not a regular file or that passes through a symbolic link."""


class StorageAuthError(StorageError):
    """The store refused the credentials it was given, or none were found."""


class StorageUnreachableError(StorageError):
    """The store's endpoint could not be reached (connection refused or timed out, after the retries)."""


class BucketNotFoundError(StorageError):
    """The bucket that the URL names does not exist (ucp never creates buckets)."""


class NotAFileError(StorageError):
    """Where an object should be, the local file system has something else (a FIFO, a device, a symbolic link):
    ucp never opens it, so it can neither hang a read nor redirect one."""
