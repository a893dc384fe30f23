"""Ranged GETs straight over HTTP from the reading thread, signed with the s3fs client's own credentials: the reads
that are most of a load from S3, without botocore's per-request pipeline.

Why: against radosgw on 127.0.0.1, a GET through s3fs and botocore costs ~1.5 ms of client CPU (endpoint rules,
event hooks, signing, parsing the answer, the hand-off to s3fs's one event loop thread, and aiohttp copying the body
there, holding the GIL), ~2 ms for 1 MiB; a GET made here costs ~0.5 and ~0.7 ms (`http.client` on a connection
kept per thread, signed by botocore's own SigV4 signer, the body read with `readinto` straight into the destination,
the GIL released while the socket is read). A 1 GiB load makes ~1,000 of them on a machine whose cores the store
may share.

What is taken from here is a success alone. Anything else (another status, no answer, a body cut off) returns None
and the caller reads again through botocore, whose retries, redirects and answer ucp's errors are told by
(`errors`): what a read means is decided in one place. Where an answer says this path may be wrong for the store (a
redirect, a bad request, a refused signature), the storage reads through botocore from then on.

Used only where it reproduces what botocore would send: the address is the one botocore itself gives for the bucket
(a presigned URL's, cut at the key), the signature SigV4 in the client's region; not through a proxy, not with
requester-pays, server-side encryption keys, version ids or another signature version (those read through botocore).
"""

from __future__ import annotations

import http.client
import inspect
import logging
import os
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import fsspec.asyn

log = logging.getLogger("ucp")

# Credentials are taken from the client again after this long (botocore refreshes temporary ones 10-15 minutes
# before they expire, so a copy this old is still valid; one that is not is refused, and that read goes to botocore)
CREDENTIALS_TTL_S = 60.0
READ_TIMEOUT_S = 60.0  # botocore's default read timeout
# Answers that may say this path does not reach the store as botocore does (another address or region, a refused
# signature): the storage reads through botocore from then on (where botocore is refused too, nothing is lost).
MISDIRECTED = frozenset({301, 307, 400, 401, 403})


class DirectReads:
    """Ranged GETs of one s3fs file system's objects over HTTP connections of each reading thread's own."""

    def __init__(self, fs: Any, client: Any):
        self.fs = fs
        self.client = client
        self.region = client.meta.region_name or "us-east-1"
        self._bases: dict[str, urllib.parse.SplitResult] = {}  # bucket -> the address of its objects
        self._signer: Any = None  # botocore's SigV4 signer with the credentials of `_signed_at`; None: anonymous
        self._signed_at = -CREDENTIALS_TTL_S
        self._lock = threading.Lock()
        self._local = threading.local()
        self._ssl: ssl.SSLContext | None = None
        self.disabled: str | None = None  # why botocore reads everything now

    @classmethod
    def of(cls, fs: Any) -> DirectReads | None:
        """The direct reads of `fs` (an s3fs file system), or None where its configuration asks for something they
        do not do (said in the log)."""
        why = _unsupported(fs)
        if why is None:
            client = fsspec.asyn.sync(fs.loop, fs.set_session)
            from botocore import UNSIGNED

            config = client.meta.config
            if getattr(config, "signature_version", None) not in (None, "s3v4", "v4", UNSIGNED):
                why = f"signature version {config.signature_version}"
            elif getattr(config, "proxies", None):
                why = "a proxy in the client's config"
            elif not callable(getattr(client, "_get_credentials", None)):
                why = "this botocore gives no client's credentials"
        if why is not None:
            log.debug("S3 reads go through botocore: %s", why)
            return None
        return cls(fs, client)

    def get_into(self, bucket: str, key: str, offset: int, buffers: Sequence[memoryview]) -> int | None:
        """A ranged GET of `key` from `offset` into `buffers` back to back: the bytes read (fewer at the object's end;
        0 for a range past it), or None where this path did not read them (the caller reads through botocore)."""
        if self.disabled is not None:
            return None
        want = sum(b.nbytes for b in buffers)
        try:
            base, headers = self._request(bucket, key, offset, want)
        except Exception as e:  # noqa: BLE001 -- the address or the credentials: botocore says what is wrong
            self.disabled = f"{type(e).__name__}: {e}"
            log.info("S3 reads go through botocore from now on: %s", self.disabled)
            return None
        path = f"{base.path}{_quote(key)}"
        for fresh in (False, True):  # (a kept connection the store has since closed fails at once: one more try)
            connection = self._connection(base, fresh)
            try:
                connection.request("GET", path, headers=headers)
                response = connection.getresponse()
            except (OSError, http.client.HTTPException):
                connection.close()
                continue
            try:
                return self._body(response, offset, buffers)
            except (OSError, http.client.HTTPException):  # (cut off on the way: botocore reads it again)
                connection.close()
                return None
            finally:
                if not response.isclosed():
                    connection.close()  # (a body not read to its end leaves nothing reusable on the connection)
        return None

    def _request(self, bucket: str, key: str, offset: int, want: int) -> tuple[urllib.parse.SplitResult, dict]:
        from botocore.awsrequest import AWSRequest

        base, signer = self._base(bucket), self._current_signer()
        headers = {"Range": f"bytes={offset}-{offset + want - 1}"}
        if signer is not None:
            url = urllib.parse.urlunsplit((base.scheme, base.netloc, f"{base.path}{_quote(key)}", "", ""))
            request = AWSRequest(method="GET", url=url, headers=headers)
            signer.add_auth(request)
            headers = dict(request.headers.items())
        return base, headers

    def _base(self, bucket: str) -> urllib.parse.SplitResult:
        """Where botocore sends a request for an object of `bucket`: its presigned URL's address and path, cut where
        the key begins (path-style: /bucket/; virtual-hosted: /)."""
        base = self._bases.get(bucket)
        if base is None:
            probe = "ucp-address-probe"
            url = fsspec.asyn.sync(
                self.fs.loop, self.client.generate_presigned_url, "get_object", {"Bucket": bucket, "Key": probe}
            )
            parts = urllib.parse.urlsplit(url)
            if not parts.path.endswith(f"/{probe}") or parts.scheme not in ("http", "https"):
                raise ValueError(f"an address that does not end with its key: {url}")
            if _proxied(parts):
                raise ValueError(f"{parts.scheme} requests to {parts.hostname} go through a proxy")
            base = self._bases[bucket] = parts._replace(path=parts.path[: -len(probe)], query="", fragment="")
        return base

    def _current_signer(self) -> Any:
        """botocore's SigV4 signer with the client's credentials as they are now (taken again every
        CREDENTIALS_TTL_S); None for an anonymous client (no credentials: requests unsigned, as botocore's are)."""
        now = time.monotonic()
        if now - self._signed_at >= CREDENTIALS_TTL_S:
            with self._lock:
                if now - self._signed_at >= CREDENTIALS_TTL_S:
                    self._signer = self._make_signer()
                    self._signed_at = now
        return self._signer

    def _make_signer(self) -> Any:
        from botocore import UNSIGNED
        from botocore.auth import S3SigV4Auth

        if getattr(self.client.meta.config, "signature_version", None) is UNSIGNED:  # (s3fs's anon=True)
            return None
        credentials = self.client._get_credentials()
        if credentials is None:
            raise ValueError("no credentials")  # (botocore's read then says so: NoCredentialsError)
        frozen = credentials.get_frozen_credentials()
        if inspect.isawaitable(frozen):  # (aiobotocore's credentials refresh on the event loop)
            frozen = fsspec.asyn.sync(self.fs.loop, _awaited, frozen)
        return S3SigV4Auth(frozen, "s3", self.region)

    def _connection(self, base: urllib.parse.SplitResult, fresh: bool) -> http.client.HTTPConnection:
        local = self._local.__dict__
        if local.get("pid") != os.getpid():  # (a forked child has its parent's sockets: never read from those)
            local["pid"], local["connections"] = os.getpid(), {}
        connections: dict[str, http.client.HTTPConnection] = local["connections"]
        connection = connections.get(base.netloc)
        if connection is None or fresh:
            if connection is not None:
                connection.close()
            host, port = base.hostname or "", base.port
            if base.scheme == "https":
                connection = http.client.HTTPSConnection(host, port, timeout=READ_TIMEOUT_S, context=self._context())
            else:
                connection = http.client.HTTPConnection(host, port, timeout=READ_TIMEOUT_S)
            connections[base.netloc] = connection
        return connection

    def _context(self) -> ssl.SSLContext:
        """TLS as botocore verifies it: the file system's `verify` (False, or a CA bundle), else AWS_CA_BUNDLE,
        else botocore's default bundle."""
        if self._ssl is None:
            from botocore.httpsession import get_cert_path

            verify = (getattr(self.fs, "client_kwargs", None) or {}).get("verify")
            if verify is False:
                context = ssl._create_unverified_context()
            else:
                cafile = verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)
                context = ssl.create_default_context(cafile=cafile)
            self._ssl = context
        return self._ssl

    def _body(self, response: http.client.HTTPResponse, offset: int, buffers: Sequence[memoryview]) -> int | None:
        """The answer's body into `buffers`: the bytes read; None where the answer is not the range asked for."""
        if response.status == 416:
            return 0  # (at or past the object's end: no bytes, as botocore's path reads none)
        content_range = response.getheader("Content-Range") or ""
        if not (
            (response.status == 206 and content_range.startswith(f"bytes {offset}-"))
            or (response.status == 200 and offset == 0)
        ):
            if response.status in MISDIRECTED and self.disabled is None:
                self.disabled = f"HTTP {response.status}"
                log.info("S3 reads go through botocore from now on: a direct GET was answered HTTP %s", response.status)
            return None
        if response.length is None:
            return None  # (no Content-Length: a body cut off could not be told from the object's end)
        got = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            at = 0
            while at < view.nbytes:
                n = response.readinto(view[at:])
                if not n:  # (the body's end: the object's, or cut off on the way, bytes of it still owed)
                    return None if response.length else got + at
                at += n
            got += at
        return got


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _quote(key: str) -> str:
    return urllib.parse.quote(key, safe="/~")  # (as botocore encodes a key in a path)


def _unsupported(fs: Any) -> str | None:
    """What of `fs`'s configuration direct reads do not reproduce, or None."""
    if getattr(fs, "version_aware", False):
        return "version-aware reads"
    if getattr(fs, "requester_pays", False) or getattr(fs, "req_kw", None):
        return "requester-pays requests"
    if getattr(fs, "s3_additional_kwargs", None):
        return f"extra request arguments ({', '.join(sorted(fs.s3_additional_kwargs))})"
    return None


def _proxied(parts: urllib.parse.SplitResult) -> bool:
    """Whether requests to this address go through a proxy of the environment's (HTTP_PROXY, HTTPS_PROXY, NO_PROXY),
    as botocore would send them."""
    proxies = urllib.request.getproxies()
    return parts.scheme in proxies and not urllib.request.proxy_bypass(parts.hostname or "")
