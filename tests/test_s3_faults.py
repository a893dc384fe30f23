"""An object store that refuses writes: after s3fs's and botocore's retries, a save fails with a StorageError that
names the step (not s3fs's bare OSError 121), removes what its attempt wrote, and leaves the committed steps alone.
A proxy in front of the S3 server (moto) answers 503 SlowDown to every PUT of a chunk object."""

from __future__ import annotations

import pytest
import torch

import ucp
from ucp.format.manifest import step_dirname
from ucp.storage import open_storage

from .helpers import assert_same_state
from .s3_proxy import FaultProxy


@pytest.fixture
def refusing_endpoint(s3_server):
    """Answers 503 SlowDown to every PUT of a chunk object; forwards everything else."""
    proxy = FaultProxy(s3_server.url)
    proxy.arm("chunk", 1, "before", times=10**9, status=503, code="SlowDown")
    try:
        yield proxy.url
    finally:
        proxy.close()


def test_a_store_that_refuses_writes_fails_the_save_naming_the_step(s3_bucket, refusing_endpoint):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/refused"
    state = {"model": {"w": torch.randn(64, 64)}}
    ucp.save(state, url, step=1, storage_options=options)
    refused = {
        **options,
        "endpoint_url": refusing_endpoint,
        "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 10},
    }
    with pytest.raises(ucp.StorageError) as failure:
        ucp.save({"model": {"w": torch.randn(64, 64)}}, url, step=2, storage_options=refused)
    message = str(failure.value)
    assert "step 2 was not saved" in message and f"{step_dirname(2)}/attempt-" in message and "\n" not in message, (
        message
    )
    assert ucp.CheckpointManager(url, storage_options=options).steps() == [1]
    assert open_storage(url, options).listdir(step_dirname(2)) == [], "the failed attempt was not removed"
    assert_same_state(state, ucp.load(url, storage_options=options))
