"""Shared fixtures: a real S3 server (moto's standalone server) on 127.0.0.1, and one that checks credentials."""

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

from .helpers import load_factor
from .launch import SEED_VARIABLE, free_port


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
def s3_server():
    """Start moto's threaded S3 server on loopback for the whole session; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A fresh bucket on the session's S3 server; the standard AWS variables point clients at it.

    Yields ``(bucket_name, storage_options)``; ``storage_options`` work with s3fs / fsspec.
    """
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    bucket = f"ucp-test-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.mkdir(bucket)
    yield bucket, options


@pytest.fixture(scope="session")
def auth_server():
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
