"""Shared fixtures: a real S3 server (moto's standalone server) on 127.0.0.1."""

from __future__ import annotations

import os
import random
import uuid

import pytest

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


def pytest_report_header(config):
    return f"test draws: {SEED_VARIABLE}={os.environ[SEED_VARIABLE]} (set it to draw the same layouts again)"


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
