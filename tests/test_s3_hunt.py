"""S3 answers that are successes but not what was asked for, and other faults a store or the network between makes, on
each server through the fault proxy (tests/s3_proxy.py): every read ends with the right bytes or a UcpError naming the
object, whichever path it takes (a direct GET, `s3_direct`; botocore's, `s3.get_into`; a whole read, `s3.get_bytes`)."""

from __future__ import annotations

import os

import pytest

from ucp.errors import StorageError
from ucp.storage import open_storage

from .helpers import DRAW
from .s3_proxy import SHIFT, WHOLE, FaultProxy

QUICK = {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 60}


@pytest.fixture
def signing_proxy(s3_server):
    """A fault proxy that signs again what it changes (radosgw checks every signature)."""
    p = FaultProxy(s3_server.url, keys=(s3_server.key, s3_server.secret))
    try:
        yield p
    finally:
        p.close()


def reads(storage, data: bytes):
    """Each way a storage reads a range of "obj" (from a random offset past 0), and the bytes it should give."""
    start = DRAW.randrange(1, len(data) - 1)
    end = DRAW.randrange(start + 1, len(data) + 1)

    def read_into() -> bytes:
        buffer = memoryview(bytearray(end - start))
        got = storage.read_into("obj", start, [buffer])
        return bytes(buffer[:got])

    def through_botocore() -> bytes:
        direct, storage._direct = storage._direct, None  # (this storage reads through botocore alone)
        try:
            return read_into()
        finally:
            storage._direct = direct

    return {
        "direct": read_into,
        "botocore": through_botocore,
        "read": lambda: bytes(storage.read("obj", start, end)),
        "read to the end": lambda: bytes(storage.read("obj", start))[: end - start],
    }, data[start:end]


def test_a_store_that_ignores_the_range_gives_the_range_not_the_objects_first_bytes(s3_bucket, signing_proxy):
    """HTTP lets a store (or a gateway, a cache) answer a ranged GET with 200 and the whole object: the bytes from the
    offset are taken from it, not its first ones."""
    bucket, options = s3_bucket
    storage = open_storage(
        f"s3://{bucket}/whole", {**options, "endpoint_url": signing_proxy.url, "config_kwargs": QUICK}
    )
    data = os.urandom(DRAW.randrange(1 << 12, 1 << 20))
    storage.write("obj", [data])
    signing_proxy.arm("read", 1, WHOLE, times=10**9, match="/obj")
    ways, expected = reads(storage, data)
    for name, read in ways.items():
        assert read() == expected, name
    assert signing_proxy.fired


def test_an_answer_of_another_range_is_read_again_and_if_it_stays_is_an_error_naming_the_object(
    s3_bucket, signing_proxy
):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/shifted"
    storage = open_storage(url, {**options, "endpoint_url": signing_proxy.url, "config_kwargs": QUICK})
    data = os.urandom(DRAW.randrange(1 << 12, 1 << 20))
    storage.write("obj", [data])
    ways, expected = reads(storage, data)
    for name, read in ways.items():
        signing_proxy.arm("read", 1, SHIFT, match="/obj")  # (once: the next answer is the range asked for)
        assert read() == expected and signing_proxy.fired, name
    for name, read in ways.items():
        signing_proxy.arm("read", 1, SHIFT, times=10**9, match="/obj")
        with pytest.raises(StorageError, match=f"cannot read {url}/obj: .*answered a GET of bytes="):
            read()
        assert signing_proxy.fired, name


def test_a_connection_the_store_drops_once_keeps_the_direct_reads(s3_bucket, signing_proxy, botocore_reads):
    """A store (or a load balancer) that closes a new connection without answering, once, as busy ones do: that read is
    botocore's, with its retries, and the next are direct again (only a store that cannot be connected to, or one that
    drops every new connection, leaves them all to botocore)."""
    from ucp.errors import StorageUnreachableError
    from ucp.storage import s3_direct

    bucket, options = s3_bucket
    storage = open_storage(
        f"s3://{bucket}/dropped", {**options, "endpoint_url": signing_proxy.url, "config_kwargs": QUICK}
    )
    storage.fs.retries = 1
    data = os.urandom(DRAW.randrange(1, 1 << 18))
    storage.write("obj", [data])

    def read() -> bytes:
        buffer = memoryview(bytearray(len(data)))
        assert storage.read_into("obj", 0, [buffer]) == len(data)
        return bytes(buffer)

    signing_proxy.arm("read", 1, "reset", match="/obj")  # (the first GET: on a new connection)
    assert read() == data and signing_proxy.fired and len(botocore_reads) == 1
    direct = storage._direct_reads()
    assert direct is not None and direct.disabled is None, direct and direct.disabled
    for _ in range(DRAW.randrange(1, 4)):
        assert read() == data
    assert len(botocore_reads) == 1, "reads after a dropped connection went through botocore"
    # a store that drops every connection: after a few, botocore reads everything (and says the store's trouble)
    direct._forget(direct._base(bucket))
    signing_proxy.arm("read", 1, "reset", times=10**9, match="/obj")
    for _ in range(s3_direct.REFUSALS):
        assert direct.disabled is None
        with pytest.raises(StorageUnreachableError, match="dropped/obj"):
            read()
    assert "no answer" in (direct.disabled or ""), direct.disabled


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_an_endpoint_that_no_proxy_names_with_its_port_is_read_directly(
    s3_server, s3_bucket, monkeypatch, botocore_reads
):
    """NO_PROXY may name a host with its port ("minio:9000"), as botocore matches it (against the endpoint's host and
    port): it sends to such an endpoint without the proxy, and so do direct reads."""

    bucket, options = s3_bucket
    netloc = options["endpoint_url"].split("://", 1)[1].rstrip("/")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # (nothing listens there: a request through it fails)
    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.setenv("NO_PROXY", f"example.com, {netloc}")
    monkeypatch.delenv("no_proxy", raising=False)
    storage = open_storage(f"s3://{bucket}/no-proxy", {**options, "config_kwargs": QUICK})
    data = os.urandom(DRAW.randrange(1, 1 << 16))
    storage.write("obj", [data])  # (botocore's: not through the proxy)
    buffer = memoryview(bytearray(len(data)))
    assert storage.read_into("obj", 0, [buffer]) == len(data) and bytes(buffer) == data
    direct = storage._direct_reads()
    assert direct is not None and direct.disabled is None and botocore_reads == [], direct and direct.disabled
