"""A load's reads from S3 are GETs made straight from the reading thread (`ucp.storage.s3_direct`), signed with the
client's credentials; anything but a success is read again through botocore, whose answer ucp's errors are told by.
Checked on each server (radosgw and moto's signature-checking server verify every signature)."""

from __future__ import annotations

import os

import pytest

from ucp.errors import StorageAuthError, StorageError
from ucp.storage import open_storage, s3, s3_direct

from .helpers import DRAW, s3_client
from .s3_proxy import CUT

QUICK = {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 60}
# keys as users name them: a path, spaces, characters that URLs and signatures encode, non-ASCII
KEYS = ("plain", "a/b/c.bin", "with space", "plus+and=eq", "percent%41", "semi;colon,comma", "ünïcødé/名前", "~tilde*")


def filled(size: int) -> memoryview:
    return memoryview(bytearray(size))


def test_reads_are_direct_and_signed_as_botocore_signs_them(auth_server, botocore_reads):
    options, bucket = auth_server
    storage = open_storage(f"s3://{bucket}/direct-{DRAW.randrange(1 << 30)}", options)
    data = {key: os.urandom(DRAW.randrange(1, 300_000)) for key in KEYS}
    for key, value in data.items():
        storage.write(key, [value])
    for key, value in data.items():
        start = DRAW.randrange(0, len(value))
        cut = DRAW.randrange(0, len(value) - start + 1)
        buffers = [filled(cut), filled(len(value) - start - cut + 7)]
        assert storage.read_into(key, start, buffers) == len(value) - start, key
        assert (bytes(buffers[0]) + bytes(buffers[1]))[: len(value) - start] == value[start:], key
        assert storage.read_into(key, len(value) + DRAW.randrange(0, 9), [filled(5)]) == 0  # (past the end: 416)
    assert botocore_reads == [], "a read went through botocore"
    assert storage._direct_reads().disabled is None
    with pytest.raises(FileNotFoundError):
        storage.read_into("missing", 0, [filled(10)])
    assert len(botocore_reads) == 1  # (the 404 is read again through botocore: its answer says what it means)


def test_a_wrong_secret_is_refused_through_botocore_and_after_a_few_refusals_leaves_its_reads_there(
    auth_server, botocore_reads
):
    options, bucket = auth_server
    root = f"s3://{bucket}/refused-{DRAW.randrange(1 << 30)}"
    open_storage(root, options).write("obj", [b"data"])
    storage = open_storage(root, {**options, "secret": "wrong"})
    for refused in range(1, s3_direct.REFUSALS + 1):
        assert storage._direct_reads().disabled is None  # (one refusal may be one object's, or one moment's)
        with pytest.raises(StorageAuthError, match="HTTP 403"):
            storage.read_into("obj", 0, [filled(4)])
        assert len(botocore_reads) == refused
    assert (storage._direct_reads().disabled or "").startswith(f"{s3_direct.REFUSALS} GETs answered")


def test_faults_on_the_way_are_read_again_and_errors_told_by_the_stores_answer(s3_bucket, proxy, botocore_reads):
    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/faults", {**options, "endpoint_url": proxy.url, "config_kwargs": QUICK})
    storage.fs.retries = 1
    data = os.urandom(DRAW.randrange(1 << 16, 1 << 20))
    storage.write("obj", [data])

    def read() -> bytes:
        whole = filled(len(data))
        assert storage.read_into("obj", 0, [whole]) == len(data)
        return bytes(whole)

    assert read() == data and botocore_reads == []
    # the answer lost (the connection reset after the store answered): the GET is made again on a fresh connection
    proxy.arm("read", 1, "reset", match="/obj")
    assert read() == data and proxy.fired and botocore_reads == []
    # a body cut off on the way, a store's 503 or 500 once: read again through botocore, which retries
    faults = ({"mode": CUT}, {"mode": "before", "status": 503, "code": "SlowDown"}, {"mode": "before"})
    once = ({"mode": "before", "status": 403, "code": "AccessDenied"}, {"mode": "before", "status": 400, "code": "X"})
    for fault in faults + once:
        botocore_reads.clear()
        proxy.arm("read", 1, match="/obj", **fault)  # type: ignore[arg-type]
        assert read() == data and proxy.fired and len(botocore_reads) == 1, fault
    assert storage._direct_reads().disabled is None  # (a store's passing trouble keeps the direct path)
    # what the store answers every time is the error, told by its answer
    proxy.arm("read", 1, "before", times=10**6, status=500, code="InternalError", message="NoSuchKey", match="/obj")
    with pytest.raises(StorageError, match="HTTP 500 InternalError"):
        read()
    proxy.arm("read", 1, "before", times=10**6, status=404, code="NoSuchKey", match="/obj")
    with pytest.raises(FileNotFoundError):
        read()
    proxy.disarm()
    assert read() == data


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_an_anonymous_client_reads_unsigned(s3_server, s3_bucket, botocore_reads):
    bucket, options = s3_bucket
    s3_client(options).put_object(Bucket=bucket, Key="anon/obj", Body=b"public bytes", ACL="public-read")
    storage = open_storage(f"s3://{bucket}/anon", {"endpoint_url": options["endpoint_url"], "anon": True})
    buffer = filled(12)
    assert storage.read_into("obj", 0, [buffer]) == 12 and bytes(buffer) == b"public bytes"
    assert botocore_reads == [], storage._direct_reads() and storage._direct_reads().disabled


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_what_direct_reads_do_not_reproduce_goes_through_botocore(s3_server, s3_bucket, botocore_reads, monkeypatch):
    bucket, options = s3_bucket
    open_storage(f"s3://{bucket}/other", options).write("obj", [b"bytes"])
    for extra in ({"requester_pays": True}, {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}}):
        storage = open_storage(f"s3://{bucket}/other", {**options, **extra})
        assert storage._direct_reads() is None, extra
        assert storage.read_into("obj", 0, [filled(5)]) == 5
    # a proxy of the environment's: botocore sends through it, so direct reads are not made
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    direct = s3_direct.DirectReads.of(open_storage(f"s3://{bucket}/other", options).fs)
    assert direct is not None and direct.get_into(bucket, "other/obj", 0, [filled(5)]) is None
    assert "proxy" in (direct.disabled or "")


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_credentials_are_taken_again_as_they_age(s3_bucket, botocore_reads, monkeypatch):
    bucket, options = s3_bucket
    monkeypatch.setattr(s3_direct, "CREDENTIALS_TTL_S", 0.0)
    storage = open_storage(f"s3://{bucket}/aging", options)
    storage.write("obj", [b"x" * 100])
    made = []
    real = s3_direct.DirectReads._make_signer
    monkeypatch.setattr(s3_direct.DirectReads, "_make_signer", lambda self: made.append(1) or real(self))
    for _ in range(3):
        assert storage.read_into("obj", 0, [filled(100)]) == 100
    assert len(made) == 3 and botocore_reads == []


def test_a_forked_child_reads_on_connections_of_its_own(s3_bucket, botocore_reads):
    """A process forked after reads (a data loader's workers) has its parent's sockets in the forking thread's
    connections: it makes its own, and parent and child read side by side, each its own bytes."""
    import multiprocessing

    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/fork", options)
    data = {f"obj{i}": os.urandom(DRAW.randrange(1 << 16, 1 << 19)) for i in range(2)}
    for key, value in data.items():
        storage.write(key, [value])
    first = filled(len(data["obj0"]))
    assert storage.read_into("obj0", 0, [first]) == len(first)  # (this thread's connection, made before the fork)

    def read_many(key: str, rounds: int) -> bool:
        for _ in range(rounds):
            buffer = filled(len(data[key]))
            if storage.read_into(key, 0, [buffer]) != len(buffer) or bytes(buffer) != data[key]:
                return False
        return True

    child = multiprocessing.get_context("fork").Process(target=lambda: os._exit(0 if read_many("obj1", 20) else 1))
    child.start()
    assert read_many("obj0", 20)
    child.join(60)
    assert child.exitcode == 0 and botocore_reads == []


def test_an_endpoint_that_stops_answering_is_left_to_botocore_within_its_timeouts(s3_bucket, botocore_reads):
    """No answer on a new connection (the endpoint gone): the read is botocore's, with its retries and connect
    timeout (an unreachable endpoint fails a command within about 30 s), and so is every read after."""
    import socket
    import time

    from ucp.errors import StorageUnreachableError

    bucket, options = s3_bucket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (nothing listens there once closed)
    config = {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 2}
    storage = open_storage(
        f"s3://{bucket}/gone", {**options, "endpoint_url": f"http://127.0.0.1:{port}", "config_kwargs": config}
    )
    began = time.monotonic()
    with pytest.raises(StorageUnreachableError):
        storage.read_into("obj", 0, [filled(10)])
    assert time.monotonic() - began < 30
    direct = storage._direct_reads()
    assert direct is not None and (direct.disabled or "").startswith("no answer from")
    assert direct.connect_timeout == 2 and len(botocore_reads) == 1


@pytest.mark.parametrize(
    "content_range, offset, want, length",
    [
        ("bytes 10-19/100", 10, 10, 10),
        ("bytes 10-99/100", 10, 500, 90),  # (to the object's end)
        ("bytes 10-18/100", 10, 10, None),  # (fewer than asked, before the object's end)
        ("bytes 0-9/100", 10, 10, None),  # (another range)
        ("bytes 10-19/*", 10, 10, 10),
        ("items 10-19/100", 10, 10, None),
        ("bytes x-19/100", 10, 10, None),
        ("", 10, 10, None),
    ],
)
def test_an_answers_range_must_be_the_one_asked_for(content_range, offset, want, length):
    assert s3.range_length(content_range, offset, want) == length


def test_connections_outlive_the_threads_that_made_them(s3_bucket, botocore_reads, monkeypatch):
    """A load's reading threads end with it; the connections they made are taken up by the next load's threads (no
    new connection, no new TLS session over HTTPS), unless the store closed them (moto answers `Connection: close`:
    then none is kept, and http.client never reopens one by itself, without the read timeout)."""
    import concurrent.futures as cf
    import http.client

    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/kept-{DRAW.randrange(1 << 30)}", options)
    data = {f"o{i}": os.urandom(DRAW.randrange(1, 1 << 18)) for i in range(DRAW.randrange(8, 24))}
    for key, value in data.items():
        storage.write(key, [value])
    connects: list[int] = []
    real = http.client.HTTPConnection.connect
    monkeypatch.setattr(http.client.HTTPConnection, "connect", lambda self: connects.append(1) or real(self))

    def load(threads: int) -> None:
        def read(key: str) -> bool:
            buffer = filled(len(data[key]))
            return storage.read_into(key, 0, [buffer]) == len(buffer) and bytes(buffer) == data[key]

        with cf.ThreadPoolExecutor(threads) as pool:  # (threads of this load alone, as a load's reads are)
            assert all(pool.map(read, list(data) * 2))

    threads = DRAW.randrange(2, 6)
    load(threads)
    made = len(connects)
    direct = storage._direct_reads()
    assert direct is not None and direct.disabled is None and botocore_reads == []
    idle = sum(len(kept) for kept in direct._idle.values())
    if idle == 0:  # (a store that closes each connection after its answer)
        assert made == 2 * len(data)
        load(threads)
        assert len(connects) == 4 * len(data)
    else:
        assert made <= threads and idle == made
        load(threads)
        assert len(connects) == made, "the second load made connections of its own"
    assert botocore_reads == []
