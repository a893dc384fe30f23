"""Shared fixtures: the S3 servers on 127.0.0.1 (every S3 test runs on moto's and, where Debian's packages are
installed, on Ceph's radosgw: `s3_server`, `s3_bucket`), and one that checks credentials (`auth_server`)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid

import pytest

from bench_io.s3_servers import S3_SERVERS

from .helpers import load_factor, s3_client
from .launch import SEED_VARIABLE, free_port
from .s3_proxy import FaultProxy


def pytest_configure(config):
    # before any test module is imported, and inherited by pytest-xdist's workers
    os.environ.setdefault(SEED_VARIABLE, str(random.SystemRandom().randrange(2**32)))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA GPU: skipped where torch sees none, so the suite stays green on CPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _seed_line() -> str:
    return f"test draws: {SEED_VARIABLE}={os.environ[SEED_VARIABLE]} (set it to draw the same layouts again)"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter):
    # (the header is not printed under -q, the README's command: the last line says it then too)
    terminalreporter.write_line(_seed_line())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Scale each test's timeout (pyproject's, or its own timeout mark) by how overloaded the machine is when the
    test starts: the 1-minute load average over the cores, at least 1. The budgets are for a machine whose cores
    the suite has to itself; at a load of 6 on 2 cores every process gets a third of a core and a test takes three
    times as long, so its timeout is three times as long too. (Runs outside pytest-timeout's own wrapper: tryfirst.)"""
    base = item.get_closest_marker("timeout")
    given = item.config.getoption("timeout", None) or item.config.getini("timeout")  # (--timeout, else pyproject's)
    seconds = base.args[0] if base is not None and base.args else given
    factor = load_factor()
    if seconds and factor > 1:
        item.add_marker(pytest.mark.timeout(float(seconds) * factor), append=False)  # (the closest mark wins)
    yield


@pytest.fixture(scope="session")
def moto_server():
    """moto's threaded S3 server on loopback for the whole session (it takes any keys and checks none)."""
    from moto.server import ThreadedMotoServer

    from bench_io.s3_servers import S3Endpoint

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Endpoint("moto", f"http://127.0.0.1:{port}", "testing", "testing")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def radosgw_server():
    """Ceph's radosgw, one for the whole run (shared by pytest-xdist's workers: tests/radosgw.py); skipped in one
    line where Debian's packages are not installed."""
    from bench_io.s3_servers import radosgw_missing

    from .radosgw import shared_radosgw

    missing = radosgw_missing()
    if missing:
        pytest.skip(missing)
    with shared_radosgw() as endpoint:
        yield endpoint


@pytest.fixture(scope="session", params=S3_SERVERS)
def s3_server(request):
    """Every S3 test runs on each server: moto (a mock, everywhere) and radosgw (a real store, where installed).
    Yields the server's `S3Endpoint` (`.server`, `.url`, `.storage_options`)."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A fresh bucket on the session's S3 server; the standard AWS variables point clients at it.

    Yields ``(bucket_name, storage_options)``; ``storage_options`` work with s3fs / fsspec.
    """
    yield fresh_bucket(s3_server, monkeypatch)


@pytest.fixture
def proxy(s3_server):
    """A `FaultProxy` in front of the session's S3 server (tests/s3_proxy.py): faults armed per request."""
    p = FaultProxy(s3_server.url)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def moto_bucket(moto_server, monkeypatch):
    """`s3_bucket` on moto alone: for a test that asks for it by name (`request.getfixturevalue`), which a fixture
    parametrized over the servers cannot answer."""
    yield fresh_bucket(moto_server, monkeypatch)


def fresh_bucket(server, monkeypatch) -> tuple[str, dict]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    bucket = f"ucp-test-{uuid.uuid4().hex[:12]}"
    make_bucket(server.storage_options, bucket)
    return bucket, server.storage_options


def make_bucket(options: dict, bucket: str) -> None:
    s3_client(options).create_bucket(Bucket=bucket)


@pytest.fixture(scope="session", params=S3_SERVERS)
def auth_server(request):
    """A server that checks signatures, with a bucket of its own: yields ``(storage_options, bucket)`` of a user who
    may write there. On radosgw, the run's server (it always checks them); on moto, a server of its own."""
    if request.param == "moto":
        return request.getfixturevalue("moto_auth_server"), "secured"
    endpoint = request.getfixturevalue("radosgw_server")
    bucket = f"secured-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint.storage_options, bucket)
    return endpoint.storage_options, bucket


@pytest.fixture(scope="session")
def moto_auth_server():
    """A moto server that checks signatures (its first 4 requests are free: they make a user, its key and policy),
    holding the bucket "secured"; yields the storage options of that user."""
    import boto3

    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="4")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        iam = boto3.client(
            "iam", endpoint_url=endpoint, aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
        )
        iam.create_user(UserName="ucp")
        key = iam.create_access_key(UserName="ucp")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="ucp", PolicyName="s3", PolicyDocument=json.dumps(policy))
        good = {"endpoint_url": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=good["key"],
            aws_secret_access_key=good["secret"],
            region_name="us-east-1",
        ).create_bucket(Bucket="secured")
        yield good
    finally:
        proc.terminate()
        proc.wait()


@pytest.fixture
def botocore_reads(monkeypatch):
    """The paths of the reads that went through botocore (`s3.get_into`)."""
    from ucp.storage import s3

    paths: list[str] = []
    real = s3.get_into

    async def counted(fs, path, *args):
        paths.append(path)
        return await real(fs, path, *args)

    monkeypatch.setattr(s3, "get_into", counted)
    return paths
