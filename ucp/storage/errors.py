"""The one place where a storage library's exception becomes a ucp error: what the exceptions of botocore,
aiobotocore, aiohttp, s3fs and the OS mean (none of them is imported here: a local checkpoint never loads an S3
client).

Where the store answered, its answer decides: the HTTP status and S3 error code as botocore parsed them
(`service_error`), never the exception's class or text. s3fs turns answers into Python exceptions by their code and
message, and stores differ in both: radosgw's 412 carries no message, so s3fs raises `OSError(22, None)` where
moto's gives `FileExistsError`; a 404 is `FileNotFoundError` whether the key or the bucket is missing; a message may
hold a key such as `step_00000412`. Only where no answer came back (no credentials found, a connection refused or
timed out, a file system that is not S3) does what the client raised say what happened."""

from __future__ import annotations

from typing import Any

from ..errors import BucketNotFoundError, StorageAuthError, StorageError, StorageUnreachableError
from .s3 import endpoint_of

# No answer: the client found no credentials to sign with
_NO_CREDENTIALS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "ProfileNotFound",
}
# An answer: the store refused the credentials (as well as any HTTP 401 or 403)
_REFUSED_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "AccessDenied"}
# An answer: the store asks the client to send fewer requests (as well as any HTTP 503)
_THROTTLED = {"SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestLimitExceeded"}
# No answer: the endpoint could not be reached
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
    """The ucp error for `e`: the kind of failure (credentials, an unreachable endpoint, a missing bucket, a store
    that throttles, anything else), `what` was being done, the cause in one line; the original is kept as
    `__cause__` by the caller's `raise ... from e`."""
    endpoint = endpoint_of(fs)
    where = f" ({endpoint})" if endpoint else ""
    cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    code, status = service_error(e)
    if code is not None or status is not None:  # the store answered: its status and code say what happened
        answer = f"HTTP {status}" + (f" {code}" if code and code != str(status) else "")
        if status in (401, 403) or code in _REFUSED_CREDENTIALS:
            return StorageAuthError(
                f"{what}: the store{where} refused the credentials or what they may do ({answer}); {_CREDENTIALS_HINT},"
                " for a user allowed to read and write there"
            )
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                f"{what}: the bucket does not exist{where}; create it first (ucp never creates buckets)"
            )
        if status == 503 or code in _THROTTLED:
            return StorageError(
                f"{what}: the store{where} asked for fewer requests ({answer}) and still did after the client's retries"
                "; give fewer requests in flight (SaveOptions(io_threads=...)) or try again later"
            )
        return StorageError(f"{what}: the store{where} answered {answer} ({cause})")
    names = {type(exc).__name__ for exc in _chain(e)}
    if names & _NO_CREDENTIALS:
        return StorageAuthError(
            f"{what}: the store{where} needs credentials and ucp found none ({cause}); {_CREDENTIALS_HINT}"
        )
    if any(isinstance(exc, PermissionError) for exc in _chain(e)):  # (a file system's refusal: no answer to read)
        return StorageAuthError(f"{what}: permission denied{where} ({cause})")
    if names & _UNREACHABLE or any(isinstance(exc, (ConnectionRefusedError, TimeoutError)) for exc in _chain(e)):
        return StorageUnreachableError(
            f"{what}: the endpoint{where} cannot be reached, after the client's retries ({cause})"
        )
    return StorageError(f"{what}: {cause}")


def precondition_failed(e: BaseException) -> bool:
    """Whether the store refused a conditional write because its condition failed (HTTP 412): an exclusive create
    that found the object there. A file system that is not S3 (no answer) says so by raising FileExistsError."""
    code, status = service_error(e)
    if code is not None or status is not None:
        return status == 412 or code == "PreconditionFailed"
    return isinstance(e, FileExistsError)


def object_missing(e: BaseException) -> bool:
    """Whether a read found no object at its key: the store answered 404 for the key (NoSuchKey; a HEAD's bare 404),
    not for the bucket (NoSuchBucket); without an answer (a file system that is not S3, or s3fs's own lookup, which
    keeps none), a FileNotFoundError."""
    code, status = service_error(e)
    if code is not None or status is not None:
        return status == 404 and code != "NoSuchBucket"
    return isinstance(e, FileNotFoundError)


def range_not_satisfiable(e: BaseException) -> bool:
    """Whether the store answered a ranged read with 416: the range starts at or beyond the object's end (an empty
    object, any range): no bytes there, as a file read past its end gives none."""
    return service_error(e)[1] == 416
