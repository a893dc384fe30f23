"""The one place where a storage library's exception becomes a ucp error: what the exceptions of botocore,
aiobotocore, aiohttp, s3fs and the OS mean, told apart by name (none of them is imported here: a local checkpoint
never loads an S3 client) and by the answer the store sent, as botocore parsed it."""

from __future__ import annotations

from typing import Any

from ..errors import BucketNotFoundError, StorageAuthError, StorageError, StorageUnreachableError
from .s3 import S3_ATTEMPTS

_AUTH = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "ProfileNotFound",
}
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
    """The ucp error for `e`: the kind of failure (credentials, an unreachable endpoint, a missing bucket, anything
    else), `what` was being done, the cause in one line; the original is kept as `__cause__` by the caller's
    `raise ... from e`."""
    endpoint = getattr(getattr(fs, "client_kwargs", None), "get", lambda _k: None)("endpoint_url") or getattr(
        fs, "endpoint_url", None
    )
    where = f" ({endpoint})" if endpoint else ""
    cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    code, _ = service_error(e)
    names = {type(exc).__name__ for exc in _chain(e)} | ({code} if code else set())
    if names & _AUTH or any(isinstance(exc, PermissionError) for exc in _chain(e)):
        return StorageAuthError(
            f"{what}: the store{where} refused the credentials, or found none ({cause}); {_CREDENTIALS_HINT}"
        )
    if names & _UNREACHABLE or any(isinstance(exc, (ConnectionRefusedError, TimeoutError)) for exc in _chain(e)):
        return StorageUnreachableError(
            f"{what}: the endpoint{where} cannot be reached after {S3_ATTEMPTS} attempts ({cause})"
        )
    if "NoSuchBucket" in names:
        return BucketNotFoundError(
            f"{what}: the bucket does not exist{where}; create it first (ucp never creates buckets)"
        )
    return StorageError(f"{what}: {cause}")


def precondition_failed(e: BaseException) -> bool:
    """Whether the store refused a conditional write because its condition failed (HTTP 412): an exclusive create
    that found the object there. Told by the answer botocore parsed, never by the message, which may hold a key such
    as step_00000412."""
    code, status = service_error(e)
    return code == "PreconditionFailed" or status == 412
