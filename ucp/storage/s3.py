"""What ucp asks of S3 (through s3fs and botocore), apart from the classification of its errors (`errors`): how
its client is configured, the checksum every put carries, and the bucket a root needs. None of it imports an S3
client at module level: a local checkpoint never loads one."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import crc32c

from ..errors import BucketNotFoundError, StorageError
from ..version import __version__

T = TypeVar("T")

PROTOCOLS = frozenset({"s3", "s3a"})

# A request that fails to connect is tried this many times in all (botocore's standard retry mode, whose backoff
# is exponential with jitter, at most 20 s between attempts), each connect waiting at most S3_CONNECT_TIMEOUT_S:
# an unreachable endpoint fails a command within about 30 s. s3fs retries throttling ("SlowDown") on its own.
S3_ATTEMPTS = 3
S3_SINGLE_PUT_BYTES = 100 << 20  # s3fs puts an object below this in one request, larger ones in parts
S3_MAX_PUT_BYTES = 5 << 30  # the most one PutObject takes (AWS's limit)
# An exclusive create's probe: a key of its own (a fresh suffix each time) under the root, created twice, removed
EXCLUSIVE_PROBE_KEY = ".ucp-exclusive-probe"
S3_CONNECT_TIMEOUT_S = 10
S3_POOL_CONNECTIONS = 64  # botocore's default pool of 10 caps concurrency
# A read of more than this is split into ranged GETs of at most this many bytes, all in flight at once: one response
# streams at a fraction of what the store serves many (a large object read in one GET among many small ones is the
# load's last to finish), as AWS's own transfer client splits them (s3transfer: parts of 8 MiB by default).
S3_PART_READ_BYTES = 8 << 20


def client_options(storage_options: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    """s3fs's arguments: the caller's `storage_options` with ucp's defaults (no listings cache, a pool as large as
    the requests in flight, bounded retries and connects) and the endpoint of AWS_ENDPOINT_URL unless one is given."""
    options = dict(storage_options)
    options.setdefault("use_listings_cache", False)
    for name in ("config_kwargs", "client_kwargs", "s3_additional_kwargs"):  # (botocore's, taken as mappings)
        if not isinstance(options.get(name) or {}, dict):
            raise StorageError(f"the storage option {name} is a mapping (JSON object), not {options[name]!r:.80}")
    config = dict(options.pop("config_kwargs", {}) or {})
    if not isinstance(config.get("s3") or {}, dict):
        raise StorageError(f"the storage option config_kwargs.s3 is a mapping (JSON object), not {config['s3']!r:.80}")
    config.setdefault("max_pool_connections", S3_POOL_CONNECTIONS)
    config.setdefault("retries", {"max_attempts": S3_ATTEMPTS, "mode": "standard"})
    config.setdefault("connect_timeout", S3_CONNECT_TIMEOUT_S)
    from botocore import __version__ as botocore_version  # (s3fs's dependency: imported only for S3)
    from botocore.config import Config

    # botocore builds its User-Agent header anew for every request (its SDK, OS, language, features and settings),
    # ~0.1 ms of a GET's ~1.1 ms of client CPU (measured against radosgw on 127.0.0.1); one fixed string costs nothing
    config.setdefault("user_agent", f"ucp/{__version__} botocore/{botocore_version}")

    # Every put carries its object's CRC-32C, which the store checks where it can (`put_checksum`), and ucp checks
    # every byte it reads: over plain http botocore would also sign a SHA-256 of every body (a pass at ~1 GB/s of a
    # core, ~8% of a save's client CPU against radosgw on 127.0.0.1), as it does not over https.
    config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
    if "response_checksum_validation" in Config.OPTION_DEFAULTS:  # (botocore >= 1.36)
        # every byte ucp reads is checked against its own CRC-32C: botocore's check of a whole object's
        # checksum (~1/4 of a GET's client time on moto) would be a second pass over the same bytes
        config.setdefault("response_checksum_validation", "when_required")
    options["config_kwargs"] = config
    if "endpoint_url" not in options and environ.get("AWS_ENDPOINT_URL"):
        options["endpoint_url"] = environ["AWS_ENDPOINT_URL"]
    return options


def put_checksum(data: bytes | bytearray | memoryview, single_put: bool = False) -> dict[str, str]:
    """The object's CRC-32C as a put's checksum (a C pass at ~10 GB/s with the GIL released): S3 checks the upload
    against it and keeps it (moto keeps it unchecked; radosgw 16 neither checks nor keeps it: ucp relies on it
    nowhere, its own checksums are in the format), and botocore computes none of its own (by default a CRC-32 of
    every byte, in zlib). Objects s3fs uploads in parts keep botocore's part checksums: none is given for those,
    unless the caller puts the object in one request whatever its size (`single_put`)."""
    if len(data) >= S3_SINGLE_PUT_BYTES and not single_put:
        return {}
    value = base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()
    return {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": value}  # (the algorithm too, or it is not kept)


def read_parts(offset: int, buffers: Sequence[memoryview]) -> list[tuple[int, list[memoryview]]]:
    """A read of `buffers` back to back from `offset` as ranged reads of at most S3_PART_READ_BYTES (buffers cut
    where a part ends): (offset, buffers) of each, in order."""
    parts: list[tuple[int, list[memoryview]]] = [(offset, [])]
    room = S3_PART_READ_BYTES
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while view.nbytes:
            if room == 0:
                offset += S3_PART_READ_BYTES
                parts.append((offset, []))
                room = S3_PART_READ_BYTES
            n = min(room, view.nbytes)
            parts[-1][1].append(view[:n])
            view, room = view[n:], room - n
    return parts


class RangeMismatchError(Exception):
    """The store answered a ranged GET with bytes other than those asked for (a 206 whose Content-Range names another
    range, or another success status): nothing of its body is taken."""


def range_length(content_range: str, offset: int, want: int | None) -> int | None:
    """The bytes a 206's Content-Range ("bytes FIRST-LAST/TOTAL") says its body holds, if it answers a range of `want`
    bytes from `offset` (all of them, or those up to the object's end; None: to the object's end); else None."""
    try:
        unit, _, rest = content_range.partition(" ")
        span, _, total = rest.partition("/")
        first, _, last = span.partition("-")
        first_n, last_n = int(first), int(last)
        if want is None:
            end = int(total)
        else:
            end = offset + want if total == "*" else min(offset + want, int(total))
    except ValueError:
        return None
    if unit != "bytes" or first_n != offset or last_n != end - 1:
        return None
    return last_n - first_n + 1


def _skipped(response: dict, offset: int, want: int | None) -> int:
    """How many bytes of a ranged GET's body come before `offset`: 0 for the range asked for; `offset` for a 200 that
    names no range, the whole object from its first byte (a store, gateway or cache may ignore a Range header, as
    HTTP allows: taking its body as the range would put the object's first bytes where those at `offset` belong).
    RangeMismatchError for anything else."""
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    content_range = response.get("ContentRange") or ""
    if status in (200, 206) and content_range and range_length(content_range, offset, want) is not None:
        return 0  # (the range asked for, whatever the success: a 200 that names its range holds it)
    if status == 200 and not content_range:
        return offset
    asked = f"bytes={offset}-{'' if want is None else offset + want - 1}"
    raise RangeMismatchError(
        f"the store answered a GET of {asked} with HTTP {status}"
        + (f" and Content-Range {content_range!r:.80}" if content_range else " and no Content-Range")
    )


async def get_into(fs: Any, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
    """A ranged GET of `path` from `offset`, its body copied into `buffers` back to back as it arrives (s3fs's
    `cat_file` joins the body into one bytes object first: a copy of every byte more, ~30% of a load's client CPU
    against radosgw); the bytes read (fewer at the object's end). Runs on `fs`'s event loop. A body cut off on the
    way, or one that is not the range asked for (`_skipped`), is read again from the start, as s3fs reads a cut one,
    up to S3_ATTEMPTS times; what the store answered propagates."""
    want = sum(b.nbytes for b in buffers)
    if want == 0:
        return 0
    return await _ranged_get(fs, path, offset, want, lambda body, skip: _fill(body, buffers, skip))


async def get_bytes(fs: Any, path: str, start: int, end: int | None) -> bytes:
    """Bytes [start, end) of `path` (to its end where `end` is None) in one ranged GET, checked as `get_into` checks
    its answers (s3fs's `cat_file` takes any success's body as the range); read again as it reads again."""
    if end is not None and end <= start:
        return b""  # (S3 ignores a range that ends before it starts, and answers the whole object)
    want = None if end is None else end - start

    async def take(body: Any, skip: int) -> bytes:
        data = await body.read()
        if skip or (want is not None and len(data) > want):  # (a whole object: the range is cut out of it)
            data = data[skip : None if want is None else skip + want]
        return data

    return await _ranged_get(fs, path, start, want, take)


async def _ranged_get(fs: Any, path: str, offset: int, want: int | None, take: Callable[[Any, int], Awaitable[T]]) -> T:
    """A GET of `want` bytes of `path` from `offset` (None: to its end), its body handed to `take` with the bytes of
    it that come before `offset` (`_skipped`); a body cut off on the way, or not of the range asked for, is read
    again from the start, up to S3_ATTEMPTS times. Runs on `fs`'s event loop."""
    from aiohttp import ClientPayloadError
    from botocore.exceptions import ResponseStreamingError

    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    last = "" if want is None else offset + want - 1
    for attempt in range(S3_ATTEMPTS):
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={offset}-{last}", **extra)
        body = response["Body"]
        try:
            return await take(body, _skipped(response, offset, want))
        except (ClientPayloadError, ResponseStreamingError, TimeoutError, RangeMismatchError):
            if attempt == S3_ATTEMPTS - 1:
                raise
        finally:
            body.close()
    raise AssertionError("unreachable")


async def _fill(body: Any, buffers: Sequence[memoryview], skip: int = 0) -> int:
    """Copy a response body into `buffers` chunk by chunk as aiohttp hands them over (`readany`: no joining), after
    its first `skip` bytes."""
    stream = getattr(getattr(body, "_raw_stream", None), "content", None)  # (aiohttp's StreamReader)
    targets = iter(memoryview(b).cast("B") for b in buffers)
    target, at, got = next(targets, None), 0, 0
    while target is not None:
        chunk = await (stream.readany() if stream is not None else body.read(1 << 20))
        if not chunk:
            break
        view = memoryview(chunk)
        if skip:
            n = min(skip, view.nbytes)
            view, skip = view[n:], skip - n
        while view.nbytes and target is not None:
            n = min(view.nbytes, target.nbytes - at)
            target[at : at + n] = view[:n]
            view, at, got = view[n:], at + n, got + n
            if at == target.nbytes:
                target, at = next(targets, None), 0
    return got


def endpoint_of(fs: Any) -> str | None:
    """The endpoint URL an s3fs file system sends its requests to, if it names one (None: AWS's own, or not S3)."""
    kwargs = getattr(fs, "client_kwargs", None)
    return (kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None) or getattr(fs, "endpoint_url", None)


def check_bucket(fs: Any, root: str, url: str) -> None:
    """Raise BucketNotFoundError unless the bucket of `root` exists (object stores have no directories: an empty
    prefix is simply empty, but its bucket must exist). Other failures propagate, for the caller to classify."""
    bucket = root.split("/", 1)[0]
    try:
        fs.call_s3("head_bucket", Bucket=bucket)  # (exists() would take a refused key for no bucket)
    except FileNotFoundError:
        raise BucketNotFoundError(
            f"no ucp checkpoint at {url}: the bucket {bucket!r} does not exist; "
            "create it first (ucp never creates buckets)"
        ) from None
