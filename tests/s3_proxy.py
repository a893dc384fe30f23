"""An HTTP proxy on 127.0.0.1 in front of an S3 server (moto or radosgw) that fails chosen requests, as an unlucky
network and store would: before forwarding (the store unchanged, the client sees an error), after forwarding (the
store changed, the client sees an error, so its retry meets its own first success), or by resetting the connection
after forwarding (the answer lost). Requests are sorted into kinds by what a save sends (`kind_of`).

`FaultProxy(upstream, strip=("If-None-Match",), keys=(key, secret))` also drops headers from every request it forwards,
as a gateway or an older S3-compatible store that ignores conditional writes does; a request it changed is signed
again with `keys` (SigV4 signs every header: a store that checks signatures, radosgw, refuses one whose signed
header was dropped). The request's Host header is forwarded as the client sent it, for the same reason."""

from __future__ import annotations

import collections
import http.client
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import crc32c

KINDS = ("chunk", "metadata", "owner", "marker", "clock", "delete", "list", "read")
MODES = ("before", "after", "reset")  # how a request fails
DAMAGE = "flip"  # a mode that does not fail it: the store's answer comes back with a byte flipped
CUT = "cut"  # the store's answer comes back cut off halfway through its body, the connection closed
# Modes that change a ranged GET before forwarding it (signed again with the proxy's `keys`, where it has them):
WHOLE = "whole"  # without its Range header, as a store or gateway that ignores Range answers (200: the whole object)
SHIFT = "shift"  # with its range one byte later: the store's 206 is of another range than the one asked for
INJECTED = "injected by the test's proxy"


def _error(code: str, message: str | None) -> bytes:
    """S3's answer to a request it failed (radosgw's carry no message)."""
    text = "" if message is None else f"<Message>{message}</Message>"
    return f"<Error><Code>{code}</Code>{text}</Error>".encode()


def kind_of(method: str, path: str, query: str) -> str:
    """What a request is, for a ucp save: a PUT of a chunk, of a zarr.json, of an attempt's owner record, of a
    commit marker or of the store-clock probe; a delete (DeleteObject, or DeleteObjects as s3fs's rm sends it);
    a listing; any other read (GET, HEAD)."""
    if method == "DELETE" or (method == "POST" and "delete" in query):
        return "delete"
    if method == "PUT":
        name = path.rsplit("/", 1)[-1]
        return {"ucp-commit.json": "marker", "ucp-attempt.json": "owner", "zarr.json": "metadata"}.get(
            name, "clock" if name == ".ucp-clock" else "chunk"
        )
    if method == "GET" and ("list-type" in query or "prefix=" in query or path.count("/") <= 1):
        return "list"
    return "read"


@dataclass(frozen=True)
class Request:
    """A request as the client sent it: its method, path and query, its headers (lower-case names) and the CRC-32C
    of its body."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body_crc32c: int


@dataclass
class Fault:
    kind: str
    nth: int  # the nth request of `kind` after arming (1-based) fails ...
    mode: str
    times: int = 1  # ... and so do the next times-1 of that kind (its client's retries)
    status: int = 500  # what the failed request is answered (modes before and after) ...
    code: str = "InternalError"
    message: str | None = INJECTED  # ... with this message and the path (None: no message, as radosgw answers)
    match: str = ""  # only requests whose path holds this count
    seen: int = 0
    fired: int = 0


class FaultProxy:
    """`arm(kind, nth, mode, times)` makes the nth next request of a kind fail (mode "flip": answered with one byte
    of the store's answer flipped, as a network or a store that damages data would); `counts` says what went through,
    `requests` lists every request."""

    def __init__(self, upstream: str, strip: tuple[str, ...] = (), keys: tuple[str, str] | None = None):
        self.upstream = urlsplit(upstream)
        self.strip = {h.lower() for h in strip}
        self.keys = keys
        self.stripped: collections.Counter[str] = collections.Counter()  # requests forwarded without a header, by it
        self.requests: list[Request] = []  # every request, as the client sent it
        self.counts: collections.Counter[str] = collections.Counter()
        self.fired: list[tuple[str, str, str]] = []  # (kind, mode, path) of each failed request
        self._fault: Fault | None = None
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"proxy": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def arm(
        self,
        kind: str,
        nth: int,
        mode: str,
        times: int = 1,
        status: int = 500,
        code: str = "InternalError",
        message: str | None = INJECTED,
        match: str = "",
    ) -> None:
        assert kind in KINDS and mode in (*MODES, DAMAGE, CUT, WHOLE, SHIFT) and nth >= 1 and times >= 1
        with self._lock:
            self._fault, self.fired = Fault(kind, nth, mode, times, status, code, message, match), []

    def disarm(self) -> None:
        with self._lock:
            self._fault = None

    def _decide(self, kind: str, path: str) -> Fault | None:
        """The fault this request meets, or None to forward it as it is."""
        with self._lock:
            self.counts[kind] += 1
            fault = self._fault
            if fault is None or fault.kind != kind or fault.match not in path:
                return None
            fault.seen += 1
            if fault.seen < fault.nth or fault.fired >= fault.times:
                return None
            fault.fired += 1
            self.fired.append((kind, fault.mode, path))
            return fault

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _signed_again(
    method: str, path: str, headers: dict[str, str], body: bytes, keys: tuple[str, str]
) -> dict[str, str]:
    """The request's headers signed again (SigV4, the region of its first signature) with `keys`."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    found = re.search(r"Credential=[^/]+/\d+/([^/]+)/s3/", headers["Authorization"])
    region = found.group(1) if found else "us-east-1"
    unsigned = ("authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token")
    request = AWSRequest(
        method=method,
        url=f"http://{headers['Host']}{path}",
        data=body,
        headers={k: v for k, v in headers.items() if k.lower() not in unsigned},
    )
    S3SigV4Auth(Credentials(*keys), "s3", region).add_auth(request)
    return dict(request.headers.items())


class _Handler(BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # (trailers)
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        body = self._body()
        split = urlsplit(self.path)
        request = Request(
            self.command, split.path, split.query, {k.lower(): v for k, v in self.headers.items()}, crc32c.crc32c(body)
        )
        with self.proxy._lock:
            self.proxy.requests.append(request)
        fault = self.proxy._decide(kind_of(self.command, split.path, split.query), self.path)
        mode = fault.mode if fault is not None else None
        refusal = None
        if fault is not None and mode in ("before", "after"):
            message = None if fault.message is None else f"{fault.message}: {split.path}"
            refusal = (fault.status, [("Content-Type", "application/xml")], _error(fault.code, message))
        if refusal is not None and mode == "before":
            return self._answer(*refusal)
        upstream = http.client.HTTPConnection(self.proxy.upstream.hostname, self.proxy.upstream.port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "transfer-encoding")}
        stripped = [k for k in headers if k.lower() in self.proxy.strip]
        for name in stripped:
            del headers[name]
            with self.proxy._lock:
                self.proxy.stripped[name.lower()] += 1
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            headers["Content-Length"] = str(len(body))
        ranged = next((k for k in headers if k.lower() == "range"), None)
        if mode in (WHOLE, SHIFT) and ranged is not None:
            first, _, last = headers.pop(ranged).removeprefix("bytes=").partition("-")
            if mode == SHIFT:
                headers[ranged] = f"bytes={int(first) + 1}-{last and int(last) + 1}"
            stripped.append(ranged)  # (changed: signed again below)
        if stripped and self.proxy.keys is not None and "Authorization" in headers:
            headers = _signed_again(self.command, self.path, headers, body, self.proxy.keys)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)  # (its Host too)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        if refusal is not None and mode == "after":
            return self._answer(*refusal)
        if mode == "reset":
            self.close_connection = True
            self.connection.shutdown(2)  # (the request reached the store; its answer never comes back)
            return None
        kept = [(k, v) for k, v in response.getheaders() if k.lower() not in ("transfer-encoding", "connection")]
        if mode == DAMAGE and data:
            at = len(data) // 2
            data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
        if mode == CUT:
            self.close_connection = True
            self.send_response(response.status)
            for k, v in kept:
                if k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(2)
            return None
        return self._answer(response.status, kept, data)

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            if k.lower() != "content-length" or self.command == "HEAD":
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.end_headers()

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

    def log_message(self, *args: object) -> None:
        pass
