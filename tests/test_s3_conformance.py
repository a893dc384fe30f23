"""What ucp relies on from an S3 store, and what it must not rely on, checked on each server (moto, and Ceph's radosgw
where it is installed; DESIGN.md, "Real S3 stores differ"):

- a commit is an exclusive create, one conditional PUT whatever its size (radosgw ignores If-None-Match on a
  multipart upload's completion); of racing creates exactly one wins; a store that ignores the condition is found
  out by a probe (once per store and process) and refuses to commit unless opened for a single writer;
- errors are told by the store's answer (status and code), not by the exception's class or text: radosgw's 412 has
  no message (s3fs raises OSError(22, None) for it), a 404 may be the key's or the bucket's, a 500's message may read
  like another error;
- ranged reads, to the end, past the end, of an empty object; a whole object is one request; a body cut off on the
  way is read again;
- packs and objects larger than s3fs's multipart threshold round-trip;
- checksums are ucp's own: a store may keep none (radosgw) or accept a wrong one, and botocore checks none on reads.

The commit's lost answer read back, the racing savers and a store that refuses writes run on both servers too
(test_commit_outcomes.py, test_races.py, test_s3_faults.py)."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import os
import subprocess
import sys
import threading

import crc32c
import pytest
import torch

import ucp
from ucp.errors import BucketNotFoundError, IntegrityError, NonExclusiveStoreError, StorageAuthError, StorageError
from ucp.format.manifest import step_dirname
from ucp.protocol import commit
from ucp.storage import S3_SINGLE_PUT_BYTES, open_storage, s3
from ucp.storage.s3 import EXCLUSIVE_PROBE_KEY

from .helpers import DRAW, assert_same_state, s3_client
from .s3_proxy import CUT, DAMAGE, FaultProxy

QUICK = {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 60}


def through(options: dict, proxy: FaultProxy) -> dict:
    """`options` with every request going through `proxy`, retried once."""
    return {**options, "endpoint_url": proxy.url, "config_kwargs": QUICK}


def crc_header(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(16, 64, generator=g) for i in range(3)}, "seed": seed}


# ------------------------------------------------------------------------------------------- exclusive creates


def test_a_second_exclusive_create_is_refused_by_the_stores_answer(s3_bucket):
    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/exclusive", options)
    storage.create_exclusive("k", b"first")
    with pytest.raises(FileExistsError) as refused:
        storage.create_exclusive("k", b"second")
    from ucp.storage import service_error

    assert service_error(refused.value)[1] == 412  # (radosgw's has no message: s3fs raised OSError(22, None))
    assert bytes(storage.read("k")) == b"first"


def test_of_racing_exclusive_creates_exactly_one_wins(s3_bucket):
    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/racing", options)
    storage.create_exclusive("warm", b"")  # (the probe, before the race)
    racers = 16
    for trial in range(4):
        start = threading.Barrier(racers)

        def create(i: int, key: str = f"k{trial}", start: threading.Barrier = start) -> bool:
            start.wait()
            try:
                storage.create_exclusive(key, f"racer {i}".encode())
                return True
            except FileExistsError:
                return False

        with cf.ThreadPoolExecutor(racers) as pool:
            won = list(pool.map(create, range(racers)))
        assert sum(won) == 1, f"trial {trial}: {sum(won)} creates won"
        assert bytes(storage.read(f"k{trial}")) == f"racer {won.index(True)}".encode()


def test_a_create_larger_than_the_multipart_threshold_is_one_put_and_stays_exclusive(s3_bucket, proxy):
    """s3fs puts an object of S3_SINGLE_PUT_BYTES or more in parts, and radosgw ignores If-None-Match on the parts'
    completion (it overwrites): an exclusive create is one PUT whatever its size, so its condition always holds."""
    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/large", through(options, proxy))
    storage.create_exclusive("probe-first", b"")  # (the probe's requests, before those counted)
    data = os.urandom(S3_SINGLE_PUT_BYTES + (1 << 20))
    proxy.requests.clear()
    storage.create_exclusive("marker", data)
    sent = [(r.method, r.query) for r in proxy.requests if r.path.endswith("/marker")]
    assert sent == [("PUT", "")], sent  # one PutObject, no multipart upload
    marker_put = next(r for r in proxy.requests if r.path.endswith("/marker"))
    assert marker_put.headers.get("if-none-match") == "*" and marker_put.body_crc32c == crc32c.crc32c(data)
    with pytest.raises(FileExistsError):
        storage.create_exclusive("marker", data[::-1])
    assert crc32c.crc32c(bytes(storage.read("marker"))) == crc32c.crc32c(data)
    proxy.requests.clear()
    storage.write("plain", [data])  # (a plain write of that size goes in parts: the threshold is real)
    assert any(r.method == "POST" and "uploads" in r.query for r in proxy.requests), "no multipart upload"


def test_a_stores_conditional_puts_are_probed_once_per_store_and_process(s3_bucket, proxy):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/probed"
    for step in (1, 2, 3):
        ucp.save(state(step), url, step=step, storage_options=through(options, proxy))
    probes = [r for r in proxy.requests if r.method == "PUT" and EXCLUSIVE_PROBE_KEY in r.path]
    assert len(probes) == 2 and len({r.path for r in probes}) == 1, probes  # one key, created twice
    assert all(r.headers.get("if-none-match") == "*" for r in probes)
    assert not [k for k in open_storage(url, options).listdir("") if EXCLUSIVE_PROBE_KEY in k]  # (removed)
    assert_same_state(state(3), ucp.load(url, storage_options=options))


def test_a_store_that_ignores_if_none_match_refuses_to_commit(s3_server, s3_bucket):
    """A gateway that drops If-None-Match (a proxy here): the probe finds a second create not refused, and the save
    fails in one line naming the endpoint and what to do; nothing is committed and the attempt is removed. Opened with
    single_writer=true, the save commits (a check, then a write) and a second save of the step is still refused."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/ignored"
    ucp.save(state(1), url, step=1, storage_options=options)  # (a root that exists: the refusal comes at the commit)
    stripping = FaultProxy(s3_server.url, strip=("If-None-Match",), keys=(options["key"], options["secret"]))
    try:
        ignoring = through(options, stripping)
        with pytest.raises(NonExclusiveStoreError) as refused:
            ucp.save(state(2), url, step=2, storage_options=ignoring)
        message = str(refused.value)
        assert stripping.url in message and "single_writer=true" in message and "\n" not in message, message
        assert stripping.stripped["if-none-match"] >= 2
        assert commit.committed_steps(open_storage(url, options)) == [1]
        assert open_storage(url, options).listdir(step_dirname(2)) == []
        with pytest.raises(NonExclusiveStoreError):  # (a new root too: refused before anything is written)
            ucp.save(state(2), f"s3://{bucket}/fresh", step=0, storage_options=ignoring)
        assert open_storage(f"s3://{bucket}/fresh", options).listdir("") == []

        single = {**ignoring, "single_writer": True}
        ucp.save(state(2), url, step=2, storage_options=single)
        with pytest.raises(ucp.StepExistsError):
            ucp.save(state(3), url, step=2, storage_options=single)
    finally:
        stripping.close()
    assert_same_state(state(2), ucp.load(url, storage_options=options))
    with pytest.raises(StorageError, match="single_writer is true or false"):
        open_storage(url, {**options, "single_writer": "yes"})


# ------------------------------------------------------------------------- errors, told by the store's answer


def test_errors_are_told_by_the_stores_answer_not_by_the_exceptions_class_or_text(s3_bucket, proxy):
    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/answers", through(options, proxy))
    storage.fs.retries = 1  # (s3fs's own retries of throttling, with its waits: one try is enough to be told)
    storage.write("obj", [b"data"])
    storage.create_exclusive("probe-first", b"")  # (the probe, before the faults)

    # the real answers: a missing key, a missing bucket (both FileNotFoundError from s3fs)
    with pytest.raises(FileNotFoundError):
        storage.read("missing")
    with pytest.raises(FileNotFoundError):
        storage.read("missing", 5, 10)
    assert storage.listdir("nothing-here") == []
    elsewhere = open_storage("s3://no-such-bucket-ucp/x", options)
    for act in (lambda: elsewhere.read("k"), lambda: elsewhere.write("k", [b"x"]), lambda: elsewhere.listdir("")):
        with pytest.raises(BucketNotFoundError):
            act()

    def injected(kind: str, status: int, code: str, message: str | None, act, times: int = 10) -> BaseException:
        proxy.arm(kind, 1, "before", times=times, status=status, code=code, message=message)
        try:
            act()
        except BaseException as e:  # noqa: BLE001 -- the test inspects it
            return e
        finally:
            proxy.disarm()
        raise AssertionError(f"{status} {code} was not raised")

    # a 404 of the bucket is not a missing object, however s3fs names it
    e = injected("read", 404, "NoSuchBucket", None, lambda: storage.read("obj"))
    assert isinstance(e, BucketNotFoundError), repr(e)
    e = injected("read", 404, "NoSuchKey", None, lambda: storage.read("obj"))
    assert isinstance(e, FileNotFoundError) and not isinstance(e, StorageError), repr(e)
    # a 500 whose message reads like a missing key or a failed condition is neither
    e = injected("read", 500, "InternalError", "The specified key does not exist.", lambda: storage.read("obj"))
    assert type(e) is StorageError and "HTTP 500 InternalError" in str(e), repr(e)
    e = injected("chunk", 500, "InternalError", "PreconditionFailed 412", lambda: storage.create_exclusive("c", b"x"))
    assert type(e) is StorageError, repr(e)
    # a 412 without a message (radosgw's) is an existing object
    e = injected("chunk", 412, "PreconditionFailed", None, lambda: storage.create_exclusive("d", b"x"), times=1)
    assert isinstance(e, FileExistsError), repr(e)
    # a 403 without a message, of any code
    e = injected("chunk", 403, "AccessDenied", None, lambda: storage.write("e", [b"x"]))
    assert isinstance(e, StorageAuthError) and "HTTP 403 AccessDenied" in str(e), repr(e)
    # throttling, still after the client's retries
    e = injected("chunk", 503, "SlowDown", None, lambda: storage.write("f", [b"x"]), times=10**6)
    assert type(e) is StorageError and "asked for fewer requests (HTTP 503 SlowDown)" in str(e), repr(e)
    assert bytes(open_storage(f"s3://{bucket}/answers", options).read("obj")) == b"data"


@pytest.mark.parametrize("s3_server", ["radosgw"], indirect=True)
def test_a_user_the_bucket_does_not_belong_to_is_refused(s3_server, s3_bucket):
    """radosgw checks who may do what (moto's server does not): a second user's keys are refused (HTTP 403)."""
    bucket, options = s3_bucket
    ucp.save(state(1), f"s3://{bucket}/mine", step=1, storage_options=options)
    stranger = {**options, "key": s3_server.stranger_key, "secret": s3_server.stranger_secret}
    with pytest.raises(StorageAuthError, match="HTTP 403"):
        ucp.load(f"s3://{bucket}/mine", storage_options=stranger)
    with pytest.raises(StorageAuthError):
        ucp.save(state(2), f"s3://{bucket}/mine", step=2, storage_options=stranger)
    assert commit.committed_steps(open_storage(f"s3://{bucket}/mine", options)) == [1]


# --------------------------------------------------------------------------------------------- ranged reads


def test_ranged_reads_to_and_past_the_end_and_a_whole_object_in_one_request(s3_bucket, proxy):
    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/ranges", through(options, proxy))
    size = DRAW.randrange(1, 3 << 20)
    data = os.urandom(size)
    storage.write("obj", [data])
    storage.write("empty", [b""])
    rng = DRAW
    for _ in range(20):
        start = rng.randrange(0, size)
        end = rng.randrange(start, size + 100)
        assert bytes(storage.read("obj", start, end)) == data[start:end], (start, end, size)
        assert bytes(storage.read("obj", start)) == data[start:], (start, size)  # (to the end)
    assert bytes(storage.read("obj", size, size + 10)) == b""  # (at the end: the store answers 416)
    assert bytes(storage.read("obj", size + 5)) == b""
    assert bytes(storage.read("empty")) == b"" and bytes(storage.read("empty", 0, 10)) == b""
    buffers = [memoryview(bytearray(7)), memoryview(bytearray(size))]
    assert storage.read_into("obj", 3, buffers) == size - 3
    assert bytes(buffers[0]) + bytes(buffers[1][: size - 10]) == data[3:]
    proxy.requests.clear()
    assert bytes(storage.read("obj")) == data
    assert [(r.method, r.headers.get("range")) for r in proxy.requests] == [("GET", "bytes=0-")]
    # a body cut off on the way is read again (read_into streams it into the buffers as it arrives)
    proxy.arm("read", 1, CUT, match="/obj")
    whole = memoryview(bytearray(size + 1))
    assert storage.read_into("obj", 0, [whole]) == size and bytes(whole[:size]) == data
    assert proxy.fired, "no answer was cut off"


def test_a_read_larger_than_a_part_is_ranged_gets_of_a_part_each(s3_bucket, proxy, monkeypatch):
    """A read of more than S3_PART_READ_BYTES is ranged GETs of at most that many bytes (in flight together, the
    buffers cut where a part ends): to the object's end, past it (a part wholly past the end is the store's 416: no
    bytes), a body cut off on the way read again, a missing object FileNotFoundError."""
    part = 64 << 10  # (the size is a parameter: 8 MiB objects would cost each server seconds)
    monkeypatch.setattr(s3, "S3_PART_READ_BYTES", part)
    bucket, options = s3_bucket
    storage = open_storage(f"s3://{bucket}/parts", through(options, proxy))
    size = DRAW.randrange(4 * part, 12 * part)
    data = os.urandom(size)
    storage.write("obj", [data])
    for _ in range(8):
        start = DRAW.randrange(0, size)
        n = DRAW.randrange(2, size - start + 2 * part)
        cuts = sorted(DRAW.sample(range(1, n), min(3, n - 1)))
        views = [memoryview(bytearray(b - a)) for a, b in zip([0, *cuts], [*cuts, n])]
        proxy.requests.clear()
        got = storage.read_into("obj", start, views)
        assert got == min(n, size - start), (start, n, size)
        assert b"".join(map(bytes, views))[:got] == data[start : start + got]
        ranges = sorted(r.headers.get("range") for r in proxy.requests if r.method == "GET")
        assert ranges == sorted(f"bytes={a}-{min(a + part, start + n) - 1}" for a in range(start, start + n, part))
    proxy.arm("read", 2, CUT, match="/obj")
    whole = memoryview(bytearray(size + 1))
    assert storage.read_into("obj", 0, [whole]) == size and bytes(whole[:size]) == data
    assert proxy.fired, "no answer was cut off"
    with pytest.raises(FileNotFoundError):
        storage.read_into("missing", 0, [memoryview(bytearray(3 * part))])


# ------------------------------------------------------------------------------- packs and large objects


@pytest.mark.slow  # (over 100 MiB through each server)
def test_packs_and_an_object_over_the_multipart_threshold_round_trip(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/large"
    g = torch.Generator().manual_seed(DRAW.randrange(2**31))
    big = torch.randn((S3_SINGLE_PUT_BYTES >> 2) + 4096, generator=g)  # one object just over the threshold
    small = {f"s{i}": torch.randn(DRAW.randrange(1, 300), generator=g) for i in range(300)}  # packed
    saved = {"model": {"big": big, **small}, "step": 1}
    policy = ucp.ChunkingPolicy(object_bytes=big.nbytes + (1 << 20), inner_bytes=8 << 20)
    ucp.save(saved, url, step=1, storage_options=options, options=ucp.SaveOptions(chunking=policy))
    listing = s3_client(options).list_objects_v2(Bucket=bucket, Prefix="large/")["Contents"]
    assert max(o["Size"] for o in listing) > S3_SINGLE_PUT_BYTES
    assert any("ucp-packs/p" in o["Key"] and "zarr.json" not in o["Key"] for o in listing)
    reader = ucp.open_checkpoint(url, 1, storage_options=options)
    assert_same_state(saved, reader.load_state())
    from ucp.engine.inspection import verify

    assert verify(reader).ok


# ------------------------------------------------------------------------------------ ucp's own checksums


def test_checksums_are_ucps_own(s3_bucket, proxy):
    """A damaged answer (a byte flipped on the way back: botocore checks no checksum on reads) and a damaged object
    that the store accepted (a put whose checksum is not its bytes': radosgw 16 and moto keep it) fail the load with
    an IntegrityError, and `ucp verify` names the chunk."""
    bucket, options = s3_bucket
    url = f"s3://{bucket}/sums"
    saved = {"model": {"w": torch.randn(256, 1024), "b": torch.randn(8)}}
    ucp.save(saved, url, step=1, storage_options=options)
    proxy.arm("read", 1, DAMAGE, match="/w/c.")
    with pytest.raises(IntegrityError, match="model/w"):
        ucp.load(url, storage_options=through(options, proxy))
    assert proxy.fired, "no answer was damaged"
    assert_same_state(saved, ucp.load(url, storage_options=options))  # (nothing is damaged in the store)

    s3 = s3_client(options)
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="sums/")["Contents"] if "/w/c." in o["Key"])
    good = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    damaged = good[:100] + bytes([good[100] ^ 0x40]) + good[101:]
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=damaged, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc_header(good))
    except Exception as e:  # noqa: BLE001 -- a store that checks the upload's checksum (AWS) refuses it: kept intact
        assert "BadDigest" in str(e) or "Checksum" in str(e), e
        return
    with pytest.raises(IntegrityError, match="model/w"):
        ucp.load(url, storage_options=options)
    out = subprocess.run(
        [sys.executable, "-m", "ucp", "verify", url, "-o", f"endpoint_url={options['endpoint_url']}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1 and "model/w" in out.stdout + out.stderr, out.stdout + out.stderr
