"""Ranged GETs straight over HTTP from the reading thread, signed with the s3fs client's own credentials: the reads
that are most of a load from S3, without botocore's per-request pipeline.

Why: against radosgw on 127.0.0.1, a GET through s3fs and botocore costs ~1.5 ms of client CPU (endpoint rules,
event hooks, signing, parsing the answer, the hand-off to s3fs's one event loop thread, and aiohttp copying the body
there, holding the GIL), ~2 ms for 1 MiB; a GET made here costs ~0.5 and ~0.7 ms (`http.client` on a kept
connection, signed by botocore's own SigV4 signer, the body read with `readinto` straight into the destination,
the GIL released while the socket is read). A 1 GiB load makes ~1,000 of them on a machine whose cores the store
may share. Connections are kept by the file system's reads, not by a thread: a load's reading threads end with it,
and the next load's take up the connections (and, over HTTPS, the sessions) the last one left open.

What is taken from here is a success alone. Anything else (another status, no answer, a body cut off) returns None
and the caller reads again through botocore, whose retries, redirects and answer ucp's errors are told by
(`errors`): what a read means is decided in one place. Where answers say this path may be wrong for the store (a
few redirects, bad requests or refused signatures), or the store cannot be connected to, answers no new connection
within the read timeout, or closes a few new ones in a row unanswered, the storage reads through botocore from then
on.

Used only where it reproduces what botocore would send: the address is the one botocore itself gives for the bucket
(a presigned URL's, cut at the key), the signature SigV4 in the client's region (or the presigned URL's); not through
a proxy, not with requester-pays, server-side encryption keys, version ids, a client certificate or another signature
version (those read through botocore).
"""

from __future__ import annotations

import http.client
import inspect
import logging
import os
import ssl
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import fsspec.asyn

from .s3 import range_length

log = logging.getLogger("ucp")

# Credentials are taken from the client again after this long (botocore refreshes temporary ones 10-15 minutes
# before they expire, so a copy this old is still valid; one that is not is refused, and that read goes to botocore)
CREDENTIALS_TTL_S = 60.0
# Answers that may say this path does not reach the store as botocore does (another address or region, a refused
# signature), or may concern one object or one moment (a prefix the user may not read, credentials that just
# expired: taken again at once). After REFUSALS of them the storage reads through botocore from then on.
MISDIRECTED = frozenset({301, 307, 400, 401, 403})
REFUSALS = 3
# Idle connections kept for each address, at most (more than the requests a load has in flight: 64 by default)
IDLE_CONNECTIONS = 128


class DirectReads:
    """Ranged GETs of one s3fs file system's objects over HTTP connections of each reading thread's own."""

    def __init__(self, fs: Any, client: Any):
        self.fs = fs
        self.client = client
        config = client.meta.config
        self.region = client.meta.region_name or "us-east-1"
        self.connect_timeout = config.connect_timeout  # (ucp's, or the user's: `s3.client_options`)
        self.read_timeout = config.read_timeout
        self._bases: dict[str, urllib.parse.SplitResult] = {}  # bucket -> the address of its objects
        self._signer: Any = None  # botocore's SigV4 signer with the credentials of `_signed_at`; None: anonymous
        self._signed_at = -CREDENTIALS_TTL_S
        self._refusals = 0
        self._dropped = 0  # new connections closed unanswered in a row (after REFUSALS, botocore reads everything)
        # address -> connections between requests, each taken by one request at a time (list.pop and append are
        # atomic: no lock, which a child forked while another thread held it would find held for good)
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._idle_pid = os.getpid()
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
            elif getattr(config, "client_cert", None):
                why = "a client certificate"
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
        if want == 0:
            return 0
        try:
            base, headers = self._request(bucket, key, offset, want)
        except Exception as e:  # noqa: BLE001 -- the address or the credentials: botocore says what is wrong
            self._disable(f"{type(e).__name__}: {e}")
            return None
        path = f"{base.path}{_quote(key)}"
        while True:
            connection, kept = None, False
            try:
                connection, kept = self._take(base)
                connection.request("GET", path, headers=headers)
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as e:
                if connection is not None:
                    connection.close()
                if kept:  # (a kept connection the store has since closed fails at once: those kept as long likely
                    self._forget(base)  # are closed too; once more on a new one)
                    continue
                why = f"no answer from {base.netloc} ({type(e).__name__}: {e})"
                if connection is None or isinstance(e, TimeoutError):
                    # no connection (refused, timed out, TLS refused), or no answer within the read timeout:
                    # botocore's reads, retries and timeouts from now on, as for a store that cannot be reached at all
                    self._disable(why)
                    return None
                # a new connection closed without an answer (a busy store or load balancer drops some): this read is
                # botocore's, with its retries; one that drops every new connection leaves them all to it
                self._dropped += 1
                if self._dropped >= REFUSALS:
                    self._disable(f"{self._dropped} new connections closed unanswered, the last {why}")
                return None
            self._dropped = 0  # (the store answers: a drop before was its passing trouble)
            try:
                got = self._body(response, offset, want, buffers)
            except (OSError, http.client.HTTPException):  # (cut off on the way: botocore reads it again)
                connection.close()
                return None
            if response.isclosed():
                self._give_back(base, connection)
            else:  # (a body not read to its end leaves nothing reusable on the connection)
                connection.close()
            return got

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            log.info("S3 reads go through botocore from now on: %s", why)

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
            if _proxied(self.client.meta.endpoint_url, parts):
                raise ValueError(f"{parts.scheme} requests to {parts.hostname} go through a proxy")
            # (a SigV4 presigned URL names the region botocore signs for, an access point's or a bucket's own)
            credential = urllib.parse.parse_qs(parts.query).get("X-Amz-Credential", [""])[0].split("/")
            if len(credential) == 5 and credential[2]:
                self.region = credential[2]
            base = self._bases[bucket] = parts._replace(path=parts.path[: -len(probe)], query="", fragment="")
        return base

    def _current_signer(self) -> Any:
        """botocore's SigV4 signer with the client's credentials as they are now (taken again every
        CREDENTIALS_TTL_S); None for an anonymous client (no credentials: requests unsigned, as botocore's are)."""
        now = time.monotonic()
        if now - self._signed_at >= CREDENTIALS_TTL_S:
            # (no lock: threads that meet an old copy at once each take the credentials, the same ones; a lock held
            # while the event loop refreshes them would be held for good in a child forked meanwhile)
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

    def _idle_at(self, base: urllib.parse.SplitResult) -> list[http.client.HTTPConnection]:
        """The idle connections to `base`."""
        if self._idle_pid != os.getpid():  # (a forked child has its parent's sockets: never read from those)
            self._idle, self._idle_pid = {}, os.getpid()
        return self._idle.setdefault(base.netloc, [])

    def _take(self, base: urllib.parse.SplitResult) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to `base` for one request, and whether it was kept from an earlier one (the store may have
        closed it since). A new one is connected here, within the client's connect timeout (its failure is the
        caller's: no answer); its reads wait at most the client's read timeout."""
        try:
            return self._idle_at(base).pop(), True
        except IndexError:
            pass
        host, port = base.hostname or "", base.port
        connection: http.client.HTTPConnection
        if base.scheme == "https":
            connection = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout, context=self._context())
        else:
            connection = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
        try:
            connection.connect()
        except BaseException:
            connection.close()  # (a TLS handshake refused leaves the connected socket in it)
            raise
        if connection.sock is not None:
            connection.sock.settimeout(self.read_timeout)
        return connection, False

    def _give_back(self, base: urllib.parse.SplitResult, connection: http.client.HTTPConnection) -> None:
        """Keep `connection` for another request, if it is still open (a store that answered `Connection: close`
        has closed it: http.client would open it again by itself, without the read timeout) and not one too many."""
        idle = self._idle_at(base)
        if connection.sock is None or len(idle) >= IDLE_CONNECTIONS:
            connection.close()
        else:
            idle.append(connection)

    def _forget(self, base: urllib.parse.SplitResult) -> None:
        """Close the idle connections to `base`."""
        idle = self._idle_at(base)
        while True:
            try:
                idle.pop().close()
            except IndexError:
                return

    def _context(self) -> ssl.SSLContext:
        """TLS as botocore verifies it: the file system's `verify` (False, or a CA bundle), else AWS_CA_BUNDLE, else
        botocore's default bundle. (A CA bundle named in an AWS profile is not read here: such a store's certificate
        fails the first handshake, and botocore reads everything from then on.)"""
        if self._ssl is None:
            from botocore.httpsession import get_cert_path

            verify = (getattr(self.fs, "client_kwargs", None) or {}).get("verify")
            if verify is False:
                context = ssl._create_unverified_context()
            elif isinstance(verify, str):
                context = ssl.create_default_context(cafile=verify)
            else:
                context = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True))
            self._ssl = context
        return self._ssl

    def _body(
        self, response: http.client.HTTPResponse, offset: int, want: int, buffers: Sequence[memoryview]
    ) -> int | None:
        """The answer's body into `buffers`: the bytes read; None where the answer is not the range asked for."""
        if response.status == 416:
            return 0  # (at or past the object's end: no bytes, as botocore's path reads none)
        if response.status in MISDIRECTED:
            self._signed_at = -CREDENTIALS_TTL_S  # (credentials that expired: the next request takes them again)
            self._refusals += 1
            if self._refusals >= REFUSALS:
                self._disable(f"{self._refusals} GETs answered HTTP 301/307/400/401/403, the last {response.status}")
            return None
        if response.length is None:
            return None  # (no Content-Length: a body cut off could not be told from the object's end)
        if response.status == 206:
            if range_length(response.getheader("Content-Range") or "", offset, want) != response.length:
                return None
        elif response.status != 200 or offset != 0:
            return None
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


def _proxied(endpoint_url: str, parts: urllib.parse.SplitResult) -> bool:
    """Whether botocore sends requests to `parts` through a proxy of the environment's (HTTP_PROXY, HTTPS_PROXY,
    NO_PROXY), as it decides: NO_PROXY matched against its client's endpoint, host and port (an entry "host:port"
    names one endpoint), the proxy chosen by the request's scheme."""
    from botocore.utils import get_environ_proxies

    return bool(get_environ_proxies(endpoint_url).get(parts.scheme))
